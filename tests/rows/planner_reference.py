"""The packing planner as it was written in Python, before its buffer became a
compiled kernel (``rows.kernels``): the oracle the kernel planner is tested against
(``test_planner_kernel.py``). Same algorithm, state format and counts as
``exactstep.rows.packing.PackPlanner`` (see that module's doc): a sorted list of
integer keys ``cost << ARRIVAL_BITS | arrival`` and a map from arrival to piece.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace

from exactstep.errors import DataError, ResumeError
from exactstep.rows.example import Example
from exactstep.rows.packing import (
    ARRIVAL_BITS,
    STATE_VERSION,
    WINDOW,
    DocumentTable,
    PackCounts,
    Piece,
    PlannerSettings,
    count_admission,
    cut_example,
    order_window,
    table_columns,
)


class ReferencePlanner(PlannerSettings):
    """Rows of pieces, packed best-fit decreasing over a bounded buffer (see module doc).

    ``cost`` (optional): the capacity a piece of a given length takes (docs/design/rows.md,
    "Charges"); ``real_tokens`` still counts tokens.
    Raises ``DataError`` when there is nothing to pack (no examples, an empty shard, or
    every example dropped) and ``DistributedError`` for an invalid ``rank``/``world``.

    The buffer is a sorted list of integer keys ``cost << ARRIVAL_BITS | arrival``
    (one per pending piece; arrivals below ``2 ** ARRIVAL_BITS``, so the order is
    that of ``(cost, arrival)``) and a map from arrival to piece. Integer keys
    compare in one machine operation, where tuples would compare element-wise.
    """

    def __init__(self, examples: Sequence[Example] | DocumentTable, **settings) -> None:
        super().__init__(examples, **settings)
        self.counts = PackCounts()
        self._keys: list[int] = []  # sorted cost << ARRIVAL_BITS | arrival
        self._pending: dict[int, Piece] = {}  # arrival -> piece
        self._next_arrival = 0
        self._exhausted = False
        self._start_epoch(0)

    # -- the order of examples (D3) ---------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self._shard: Sequence[int] = self.table.shard_order(
            self.seed, epoch, shuffle=self.shuffle, rank=self.rank, world=self.world
        )
        self._shard_len = len(self._shard)
        self.epoch = epoch
        self.cursor = 0
        self._admitted_this_epoch = 0
        self._window_start = 0
        self._window_ids: list[int] = []
        self._window_lengths: list[int] = []
        self._window_targets: list[int] = []

    def _admit(self, index: int, n: int, targets: int) -> None:
        """Admit example ``index`` of ``n`` tokens and ``targets`` owned targets."""
        if n <= self.seq_len:  # the common case, kept cheap
            c = self.counts
            c.documents += 1
            c.tokens += n
            c.targets += targets
            self._push(Piece(index, 0, n, 0, self.epoch))
            self._admitted_this_epoch += 1
            return
        example = self.table[index]
        runs, lost = cut_example(example, self.seq_len, self.overlong, self.overlap_split)
        self._count_admission(example, runs, lost)
        for k, (offset, length) in enumerate(runs):
            self._push(Piece(example=index, offset=offset, length=length, piece=k,
                             epoch=self.epoch))
        self._admitted_this_epoch += len(runs)

    def _count_admission(self, example: Example, runs: list[tuple[int, int]], lost: int) -> None:
        count_admission(self.counts, example, runs, lost, self.overlong, self.seq_len)

    def _refill(self) -> None:
        while len(self._keys) < self.buffer and not self._exhausted:
            if self.cursor == self._shard_len:
                if not self.repeat:
                    self._exhausted = True
                    break
                if self._keys:
                    break  # epoch barrier: drain this epoch before the next begins
                if self._admitted_this_epoch == 0:
                    raise DataError(
                        f"rank {self.rank}'s shard has no example that fits batch.seq_len = "
                        f"{self.seq_len} under batch.overlong = 'drop'; change one of them"
                    )
                self._start_epoch(self.epoch + 1)
                continue
            j = self.cursor - self._window_start
            if j >= len(self._window_ids):
                self._read_window()
                j = 0
            self._admit_run(j, min(j + self.buffer - len(self._keys), len(self._window_ids)))

    def _admit_run(self, j: int, stop: int) -> None:
        """Admit window entries ``j, j + 1, ...`` (at most up to ``stop``) in order, as
        ``_admit`` would one by one: a short example adds exactly one piece, so
        ``stop - j`` of them fill the ``stop - j`` free places; the run ends after
        the first over-long one (its pieces are counted by ``_admit``)."""
        ids, lengths = self._window_ids, self._window_lengths
        seq_len, epoch, keys, pending = self.seq_len, self.epoch, self._keys, self._pending
        cost = self.cost if self.charged else None
        arrival = self._next_arrival
        start = j
        tokens = 0
        insort = bisect.insort
        while j < stop:
            n = lengths[j]
            if n > seq_len:
                break
            pending[arrival] = Piece(ids[j], 0, n, 0, epoch)
            insort(keys, (n if cost is None else cost(n)) << ARRIVAL_BITS | arrival)
            arrival += 1
            tokens += n
            j += 1
        c = self.counts
        c.documents += j - start
        c.tokens += tokens
        c.targets += sum(self._window_targets[start:j])
        self._next_arrival = arrival
        self._admitted_this_epoch += j - start
        self.cursor += j - start
        if j < stop:  # an over-long example: cut, counted and pushed by _admit
            self._admit(ids[j], lengths[j], self._window_targets[j])
            self.cursor += 1

    def _read_window(self) -> None:
        """Read the next ``WINDOW`` positions of the epoch order from the cursor: ids,
        lengths and owned targets, as lists (a cache of the table, never state)."""
        stop = min(self.cursor + WINDOW, self._shard_len)
        ids = order_window(self._shard, self.cursor, stop)
        lengths, targets = table_columns(self.table, ids)
        self._window_lengths, self._window_targets = lengths.tolist(), targets.tolist()
        ids = ids.tolist()
        self._window_ids = ids
        self._window_start = self.cursor

    # -- the bounded buffer -------------------------------------------------------------

    def _push(self, piece: Piece) -> None:
        arrival = self._next_arrival
        self._next_arrival += 1
        self._pending[arrival] = piece
        bisect.insort(self._keys, self.cost(piece.length) << ARRIVAL_BITS | arrival)

    # -- rows ---------------------------------------------------------------------------

    def next_row(self) -> list[Piece] | None:
        """The pieces of the next row, in column order, or ``None`` when a finite
        stream is exhausted."""
        self._refill()
        if not self._keys:
            return None
        row: list[Piece] = []
        space = self.seq_len
        keys, pending = self._keys, self._pending
        left = bisect.bisect_left
        mask = (1 << ARRIVAL_BITS) - 1
        while space > 0:
            # the longest pending piece that fits (the last key below cost space + 1),
            # earliest arrival on ties (the first key of that cost)
            idx = left(keys, (space + 1) << ARRIVAL_BITS) - 1
            if idx < 0:
                break
            cost = keys[idx] >> ARRIVAL_BITS
            if idx and keys[idx - 1] >> ARRIVAL_BITS == cost:
                idx = left(keys, cost << ARRIVAL_BITS)
            piece = pending.pop(keys.pop(idx) & mask)
            row.append(piece)
            space -= cost
        self.counts.rows += 1
        self.counts.real_tokens += (sum(piece.length for piece in row) if self.charged
                                    else self.seq_len - space)  # uncharged: cost = length
        return row

    def next_rows(self, k: int) -> list[list[Piece]]:
        """Up to ``k`` rows; fewer only at the end of a finite stream."""
        rows: list[list[Piece]] = []
        while len(rows) < k:
            row = self.next_row()
            if row is None:
                break
            rows.append(row)
        return rows

    def next_plan(self, k: int) -> list[list[Piece]]:
        """``next_rows``: the rows every compiler reads (``PackPlanner.next_plan``
        returns them as a ``RowPlan``)."""
        return self.next_rows(k)

    def snapshot(self):
        """The state now, as ``PackPlanner.snapshot`` gives it (here built at once)."""
        state = self.state_dict()
        return SimpleNamespace(state_dict=lambda: state)

    def pending(self) -> list[Piece]:
        """The pending pieces in arrival order."""
        return [self._pending[a] for a in sorted(self._pending)]

    @property
    def pending_pieces(self) -> int:
        """Pieces admitted but not yet placed in a row (the packer remainder)."""
        return len(self._pending)

    # -- state (S2) ---------------------------------------------------------------------

    def state_dict(self) -> dict:
        """JSON-serialisable position: epoch, cursor, pending pieces, counters."""
        pending = [
            [arrival, p.example, p.offset, p.length, p.piece]
            for arrival, p in sorted(self._pending.items())
        ]
        return {
            "version": STATE_VERSION,
            "settings": self.settings(),
            "epoch": self.epoch,
            "cursor": self.cursor,
            "exhausted": self._exhausted,
            "admitted_this_epoch": self._admitted_this_epoch,
            "next_arrival": self._next_arrival,
            "pending": pending,
            "counts": dataclasses.asdict(self.counts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken. Raises ``ResumeError`` if the
        state belongs to a planner with different settings or data size."""
        self.check_state(state)
        self._start_epoch(int(state["epoch"]))
        self.cursor = int(state["cursor"])  # the window is read again from here
        self._exhausted = bool(state["exhausted"])
        self._admitted_this_epoch = int(state["admitted_this_epoch"])
        self._next_arrival = int(state["next_arrival"])
        self._pending = {
            # pending pieces are all of the saved epoch (the epoch barrier)
            int(a): Piece(example=int(e), offset=int(o), length=int(n), piece=int(k),
                          epoch=self.epoch)
            for a, e, o, n, k in state["pending"]
        }
        if self._next_arrival >= 1 << ARRIVAL_BITS:
            raise ResumeError(f"packer state has {self._next_arrival} arrivals, more than "
                              f"2**{ARRIVAL_BITS}; it was not written by this planner")
        self._keys = sorted(self.cost(p.length) << ARRIVAL_BITS | a
                            for a, p in self._pending.items())
        self.counts = PackCounts(**state["counts"])


class LatestOnTies(ReferencePlanner):
    """A deliberately wrong planner for negative controls: best-fit ties go to the
    latest arrival instead of the earliest (the last key of the chosen cost)."""

    def next_row(self):
        self._refill()
        if not self._keys:
            return None
        row, space, keys = [], self.seq_len, self._keys
        while space > 0:
            idx = bisect.bisect_left(keys, (space + 1) << ARRIVAL_BITS) - 1
            if idx < 0:
                break
            cost = keys[idx] >> ARRIVAL_BITS
            row.append(self._pending.pop(keys.pop(idx) & ((1 << ARRIVAL_BITS) - 1)))
            space -= cost
        self.counts.rows += 1
        self.counts.real_tokens += sum(piece.length for piece in row)
        return row
