"""The packing plan: which pieces of which examples fill each row (R3, R4, D3).

Knowing only lengths and target counts, the planner packs best-fit decreasing over a
bounded buffer, deterministic for a seed and sharded by rank (D3), and cuts
over-long examples by the declared outcome, counting each (R4); a family's compiler
turns its rows of ``Piece`` into a ``Batch``. Its state resumes bitwise (S2, S5).
Design and derivations: docs/design/rows.md#rowspackingpy (R3, R4, R8, D3, S2, S5, P2).
Picture of a packed row: docs/concepts/rows.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np

from exactstep.errors import DataError, DistributedError, ResumeError
from exactstep.rows import kernels
from exactstep.rows.example import Example

STATE_VERSION = 1
WINDOW = 4096  # positions of the epoch order read from the table at once
SLACK = 64  # buffer slots beyond `buffer`: room for the pieces of a cut example
ARRIVAL_BITS = kernels.ARRIVAL_BITS  # arrivals stay below 2 ** ARRIVAL_BITS


class Piece(NamedTuple):
    """A contiguous run ``[offset, offset + length)`` of example ``example`` (an index
    into the planner's example list); ``piece`` is 0 for the first run of an example and
    ``k`` for the ``k``-th continuation after a split (R6). ``epoch`` is the epoch that
    admitted it: stochastic compilers (masked LM, span corruption, permutation LM, R8)
    address their random draws by ``(seed, epoch, example id, piece)``, so packing,
    sharding and resume never change them. It is not part of the saved state: the
    epoch barrier means every pending piece belongs to the planner's current epoch."""

    example: int
    offset: int
    length: int
    piece: int
    epoch: int = 0


@dataclass
class PackCounts:
    """Counters of everything the planner admitted and emitted (the data report, R4).

    ``documents``/``tokens``/``targets``: examples admitted (repeats counted each epoch),
    their tokens and their owned in-example targets. ``*_targets_lost``: owned targets
    that no row will supervise because of the over-long outcome. ``rows``/``real_tokens``:
    rows emitted and the non-padding slots they hold.
    """

    documents: int = 0
    tokens: int = 0
    targets: int = 0
    split_documents: int = 0
    split_pieces: int = 0
    split_targets_lost: int = 0
    split_repeated_tokens: int = 0
    truncated_documents: int = 0
    truncated_tokens: int = 0
    truncated_targets_lost: int = 0
    dropped_documents: int = 0
    dropped_tokens: int = 0
    dropped_targets_lost: int = 0
    rows: int = 0
    real_tokens: int = 0


assert tuple(f.name for f in dataclasses.fields(PackCounts)) == kernels.COUNTS[:-1]


def cut_example(
    example: Example, seq_len: int, overlong: str, overlap_split: bool
) -> tuple[list[tuple[int, int]], int]:
    """``(offset, length)`` runs for one example under the over-long policy, and the
    number of owned targets the cut loses."""
    n = len(example)
    if n <= seq_len:
        return [(0, n)], 0
    if overlong == "drop":
        return [], example.targets_in(1, n)
    if overlong == "truncate":
        return [(0, seq_len)], example.targets_in(seq_len, n)
    if overlap_split:
        stride = seq_len - 1
        starts = range(0, n - 1, stride)
        return [(s, min(seq_len, n - s)) for s in starts], 0
    runs = [(s, min(seq_len, n - s)) for s in range(0, n, seq_len)]
    lost = sum(example.targets_in(s, s + 1) for s, _ in runs[1:])
    return runs, lost


def count_admission(counts: PackCounts, example: Example, runs: list[tuple[int, int]],
                    lost: int, overlong: str, seq_len: int) -> None:
    """Count an over-long example's admission under its policy (R4): its tokens and
    targets, and what ``cut_example``'s ``runs`` and ``lost`` targets cost."""
    c, n = counts, len(example)
    c.documents += 1
    c.tokens += n
    c.targets += example.targets_in(1, n)
    if overlong == "drop":
        c.dropped_documents += 1
        c.dropped_tokens += n
        c.dropped_targets_lost += lost
    elif overlong == "truncate":
        c.truncated_documents += 1
        c.truncated_tokens += n - seq_len
        c.truncated_targets_lost += lost
    else:
        c.split_documents += 1
        c.split_pieces += len(runs)
        c.split_targets_lost += lost
        c.split_repeated_tokens += sum(length for _, length in runs) - n


@runtime_checkable
class DocumentTable(Protocol):
    """What the planner reads about its examples: how many, each one's length and
    owned targets, the example itself (only for over-long cuts), and each epoch's
    order for a rank (D3). ``ExampleTable`` serves a list in memory; a prepared
    corpus (``rows.prepared``) serves memory-mapped shards without a list (P2).

    Optional, for speed only (same values): ``columns(ids)`` returns the lengths and
    targets of ``ids`` (int64) as two arrays (``table_columns``), an order may have
    ``window(start, stop)`` (``order_window``), and ``plain = True`` says that every
    example's targets are all its tokens but the first (text), so that the
    planner's kernel cuts over-long examples itself."""

    lengths: Sequence[int]
    targets: Sequence[int]
    min_length: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Example: ...

    def first_empty(self) -> int | None: ...

    def shard_order(
        self, seed: int, epoch: int, *, shuffle: bool, rank: int, world: int
    ) -> Sequence[int]: ...


def order_window(order: Sequence[int], start: int, stop: int) -> np.ndarray:
    """Ids at positions ``[start, stop)`` of an epoch order, int64: through the
    order's own ``window(start, stop)`` when it has one (``rows.prepared``'s block
    order computes a whole window at once), else by slicing."""
    window = getattr(order, "window", None)
    if window is not None:
        return np.asarray(window(start, stop), dtype=np.int64)
    return np.asarray(order[start:stop], dtype=np.int64)


def table_columns(table: DocumentTable, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lengths and owned targets of examples ``ids``, int64: through the table's own
    ``columns(ids)`` when it has one (a whole window of the document index at once),
    else one look-up per id."""
    columns = getattr(table, "columns", None)
    if columns is not None:
        return columns(ids)
    lengths, targets = table.lengths, table.targets
    return (np.array([lengths[i] for i in ids.tolist()], dtype=np.int64),
            np.array([targets[i] for i in ids.tolist()], dtype=np.int64))


def planner_table(examples, *, seq_len: int, overlong: str, rank: int,
                  world: int) -> DocumentTable:
    """The ``DocumentTable`` a planner reads (``examples`` itself, or an
    ``ExampleTable`` of a list), refused with ``DistributedError`` for an invalid
    rank and ``DataError`` when there is nothing to pack: no examples, fewer than
    ranks, an empty one, or every one dropped."""
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"rank {rank} is not in [0, world = {world}); check the launch")
    table = examples if isinstance(examples, DocumentTable) else ExampleTable(examples)
    if not len(table):
        raise DataError("there are no examples to pack; check data.source and data.max_docs")
    if len(table) < world:
        raise DataError(
            f"{len(table)} examples cannot be sharded over {world} ranks; "
            "use more data or fewer ranks"
        )
    empty = table.first_empty()
    if empty is not None:
        raise DataError(f"example {table[empty].example_id} has no tokens; remove it")
    if overlong == "drop" and table.min_length > seq_len:
        raise DataError(
            f"every example is longer than batch.seq_len = {seq_len} and batch.overlong = "
            "'drop'; raise batch.seq_len or set batch.overlong to 'split' or 'truncate'"
        )
    return table


class ExampleTable:
    """Examples held in memory. Order: a permutation of every index drawn from
    ``(seed, epoch)`` with NumPy's ``Generator`` (or the identity without shuffle),
    then ``order[rank::world]`` (D3)."""

    def __init__(self, examples: Sequence[Example]) -> None:
        self.examples = examples
        lengths = np.fromiter((len(e) for e in examples), dtype=np.int64, count=len(examples))
        self._empty = np.flatnonzero(lengths == 0)
        self.min_length = int(lengths.min()) if len(lengths) else 0
        self.lengths: list[int] = lengths.tolist()
        self.targets: list[int] = [e.targets_in(1, len(e)) for e in examples]
        self._columns = np.stack([lengths, np.asarray(self.targets, dtype=np.int64)
                                  .reshape(-1)])  # [2, n]
        self.plain = all(e.owned is None for e in examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def columns(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and owned targets of examples ``ids`` (int64 arrays)."""
        lengths, targets = self._columns[:, ids]
        return lengths, targets

    def first_empty(self) -> int | None:
        return int(self._empty[0]) if len(self._empty) else None

    def shard_order(
        self, seed: int, epoch: int, *, shuffle: bool, rank: int, world: int
    ) -> list[int]:
        n = len(self.examples)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        return order[rank::world].tolist()


class RowPlan(Sequence[list[Piece]]):
    """Rows of placed pieces as arrays, as the planner produces them: ``pieces``
    ``[PLAN_FIELDS, P]`` (``rows.kernels``: example, offset, length, piece, first
    column), ``epochs [P]`` (given as one ``int`` when one epoch admitted every
    piece, and then built on first use) and ``row_starts [R + 1]`` (row ``r`` holds
    pieces ``row_starts[r]:row_starts[r + 1]``). As a sequence it is the rows of
    ``Piece`` that every compiler reads (built once, on first use); a compiler that
    reads arrays (``rows.causal`` over prepared shards) reads them directly."""

    def __init__(self, pieces: np.ndarray, epochs: np.ndarray | int,
                 row_starts: np.ndarray) -> None:
        self.pieces = pieces
        self._epochs = epochs
        self.row_starts = row_starts
        self._rows: list[list[Piece]] | None = None

    @property
    def epochs(self) -> np.ndarray:
        """The epoch that admitted each piece, ``[P]`` int64."""
        if not isinstance(self._epochs, np.ndarray):
            self._epochs = np.full(self.pieces.shape[1], self._epochs, dtype=np.int64)
        return self._epochs

    def rows(self) -> list[list[Piece]]:
        """The rows as lists of ``Piece``."""
        if self._rows is None:
            fields = self.pieces[:4].tolist()
            every = list(map(Piece, *fields, self.epochs.tolist()))
            bounds = self.row_starts.tolist()
            self._rows = [every[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return self._rows

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, r):  # type: ignore[override]
        return self.rows()[r]

    def __iter__(self):
        return iter(self.rows())


@dataclass(frozen=True)
class PlannerSnapshot:
    """A planner's position at one moment (``PackPlanner.snapshot``): the scalars,
    a copy of its buffer's slots and of its counts."""

    settings: dict
    epoch: int
    cursor: int
    exhausted: bool
    admitted_this_epoch: int
    next_arrival: int
    slots: np.ndarray
    counts: PackCounts

    def state_dict(self) -> dict:
        """The planner's ``state_dict()`` at the moment of the snapshot."""
        pending = [list(p) for p in zip(*kernels.pending_columns(self.slots), strict=True)]
        return {
            "version": STATE_VERSION,
            "settings": dict(self.settings),
            "epoch": self.epoch,
            "cursor": self.cursor,
            "exhausted": self.exhausted,
            "admitted_this_epoch": self.admitted_this_epoch,
            "next_arrival": self.next_arrival,
            "pending": pending,
            "counts": dataclasses.asdict(self.counts),
        }


class PlannerSettings:
    """What a planner of this module's algorithm is given, checked: the table
    (``planner_table``), the order's and the cut's settings, and the charges
    (``cost``; ``charged`` says whether a compiler gave them). ``settings()`` is
    what a saved state must match; ``check_state`` refuses one that does not (S2).
    ``PackPlanner`` and the tests' Python oracle both start from it."""

    def __init__(
        self,
        examples: Sequence[Example] | DocumentTable,
        *,
        seq_len: int,
        buffer: int,
        overlong: str,
        seed: int,
        shuffle: bool = True,
        repeat: bool = True,
        rank: int = 0,
        world: int = 1,
        overlap_split: bool = False,
        cost: Callable[[int], int] | None = None,
    ) -> None:
        self.examples = examples
        self.table = planner_table(examples, seq_len=seq_len, overlong=overlong, rank=rank,
                                   world=world)
        self.seq_len = seq_len
        self.buffer = buffer
        self.overlong = overlong
        self.seed = seed
        self.shuffle = shuffle
        self.repeat = repeat
        self.rank = rank
        self.world = world
        self.overlap_split = overlap_split
        self.cost = cost or (lambda length: length)
        self.charged = cost is not None  # else a piece's cost is its length
        if self.cost(seq_len) > seq_len:
            raise DataError(f"a piece of {seq_len} tokens costs {self.cost(seq_len)} > "
                            f"{seq_len}: the compiler's charges do not fit its own rows")

    def settings(self) -> dict:
        return {
            "examples": len(self.table),
            "seq_len": self.seq_len,
            "buffer": self.buffer,
            "overlong": self.overlong,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "repeat": self.repeat,
            "rank": self.rank,
            "world": self.world,
            "overlap_split": self.overlap_split,
        }

    def check_state(self, state: dict) -> None:
        """Raise ``ResumeError`` unless ``state`` is of this version and was saved
        with these settings and this data size (each differing setting named)."""
        if state.get("version") != STATE_VERSION:
            raise ResumeError(
                f"packer state version {state.get('version')!r} is not {STATE_VERSION}"
            )
        saved, now = state["settings"], self.settings()
        differing = sorted(k for k, v in now.items() if saved.get(k) != v)
        if differing:
            raise ResumeError(
                "the packer state was saved with different settings: "
                + ", ".join(f"{k} (saved {saved.get(k)!r}, now {now[k]!r})" for k in differing)
            )


class PackPlanner(PlannerSettings):
    """Rows of pieces, packed best-fit decreasing over a bounded buffer (R4).
    Its settings are ``PlannerSettings``'s keyword arguments. Algorithm, over-long
    outcomes and determinism: docs/design/rows.md#rowspackingpy.

    ``cost`` (optional): the capacity a piece of a given length takes; it must be
    non-decreasing with ``cost(seq_len) <= seq_len`` (else ``DataError``), and cuts
    are still made in tokens; ``real_tokens`` still counts tokens.
    Raises ``DataError`` when there is nothing to pack (no examples, an empty shard, or
    every example dropped) and ``DistributedError`` for an invalid ``rank``/``world``.

    The buffer is ``rows.kernels.PieceBuffer`` (a queue of pending pieces per cost
    and a bitmap of the costs present: the best fit is the head of the highest
    cost that fits, the earliest arrival among ties), refilled and emptied into rows
    by compiled kernels (``admit`` and ``plan_rows`` of ``kernels.c``); the planner
    itself, in Python, reads the next window of the order, cuts over-long examples by
    their ownership and moves from one epoch to the next (the places the kernel hands
    back).
    """

    def __init__(self, examples: Sequence[Example] | DocumentTable, **settings) -> None:
        super().__init__(examples, **settings)
        # the charge of every piece length a row can hold (pieces are never longer)
        seq_len, buffer = self.seq_len, self.buffer
        self._costs = (np.array([self.cost(n) for n in range(seq_len + 1)], dtype=np.int64)
                       if self.charged else np.arange(seq_len + 1, dtype=np.int64))
        self._counts = PackCounts()
        rule = {"split": kernels.SPLIT, "truncate": kernels.TRUNCATE, "drop": kernels.DROP}
        settings = [rule[self.overlong], self.overlap_split,
                    bool(getattr(self.table, "plain", False)), seq_len, buffer]
        self._buf = kernels.PieceBuffer(self._costs, np.array(settings, dtype=np.int64),
                                        buffer + SLACK)
        self._flushed = np.zeros(len(kernels.COUNTS), dtype=np.int64)
        self._exhausted = False
        self._start_epoch(0)

    @property
    def counts(self) -> PackCounts:
        """Everything admitted and emitted so far (the data report, R4)."""
        self._flush()
        return self._counts

    @counts.setter
    def counts(self, counts: PackCounts) -> None:
        self._flushed = self._buf.counts.copy()
        self._counts = counts

    def _flush(self) -> None:
        """Move the counts the kernels added since the last flush into ``counts`` and
        the epoch's admissions."""
        grown = self._buf.counts - self._flushed
        self._flushed = self._buf.counts.copy()
        added = grown.tolist()
        c = self._counts.__dict__
        for name, value in zip(kernels.COUNTS[:-1], added, strict=False):
            c[name] += value
        self._admitted_this_epoch += added[kernels.ADMITTED]

    @property
    def cursor(self) -> int:
        """Position of the next example to admit in this epoch's order (for this rank)."""
        return self._window_start + int(self._buf.state[kernels.CURSOR])

    @cursor.setter
    def cursor(self, position: int) -> None:
        self._buf.state[kernels.CURSOR] = position - self._window_start

    @property
    def _next_arrival(self) -> int:
        return int(self._buf.state[kernels.NEXT_ARRIVAL])

    # -- the order of examples (D3) ---------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self._shard: Sequence[int] = self.table.shard_order(
            self.seed, epoch, shuffle=self.shuffle, rank=self.rank, world=self.world
        )
        self._shard_len = len(self._shard)
        self.epoch = epoch
        self._window_start = 0
        self._buf.set_window(np.zeros((3, 0), dtype=np.int64))  # ids, lengths, targets
        self._admitted_this_epoch = 0

    def _admit(self, index: int, n: int, targets: int) -> None:
        """Admit over-long example ``index`` (``n > seq_len`` tokens): cut under the
        over-long policy, counted, its pieces pushed."""
        example = self.table[index]
        runs, lost = cut_example(example, self.seq_len, self.overlong, self.overlap_split)
        self._count_admission(example, runs, lost)
        for k, (offset, length) in enumerate(runs):
            self._push(index, offset, length, k)
        self._admitted_this_epoch += len(runs)

    def _count_admission(self, example: Example, runs: list[tuple[int, int]], lost: int) -> None:
        count_admission(self.counts, example, runs, lost, self.overlong, self.seq_len)

    def _refill(self) -> None:
        """Refill the buffer to ``buffer`` pieces where the kernel hands back: read
        the next window, cut an over-long example, end the epoch (its barrier:
        drain this epoch before the next begins) or the finite stream."""
        buf = self._buf
        state = buf.state
        self._flush()
        while state[kernels.N] < self.buffer and not self._exhausted:
            if self.cursor == self._shard_len:
                if not self.repeat:
                    self._exhausted = True
                    break
                if state[kernels.N]:
                    break  # epoch barrier: drain this epoch before the next begins
                if self._admitted_this_epoch == 0:
                    raise DataError(
                        f"rank {self.rank}'s shard has no example that fits batch.seq_len = "
                        f"{self.seq_len} under batch.overlong = 'drop'; change one of them"
                    )
                self._start_epoch(self.epoch + 1)
                continue
            if state[kernels.CURSOR] >= buf.window.shape[1]:
                self._read_window()
            j = int(state[kernels.CURSOR])
            if buf.window[1, j] > self.seq_len and not buf.settings[kernels.PLAIN]:
                index, n, targets = buf.window[:, j].tolist()
                self._admit(index, n, targets)  # cut by its ownership, in Python
                self.cursor += 1
                continue
            buf.admit()
            self._flush()
            if state[kernels.CURSOR] == j:  # the next example's pieces need more slots
                buf.grow()

    def _read_window(self) -> None:
        """Read the next ``WINDOW`` positions of the epoch order from the cursor: ids,
        lengths and owned targets (a cache of the table, never state)."""
        start = self.cursor
        stop = min(start + WINDOW, self._shard_len)
        ids = order_window(self._shard, start, stop)
        lengths, targets = table_columns(self.table, ids)
        self._buf.set_window(np.stack([ids, lengths, targets]))
        self._window_start = start

    # -- the bounded buffer -------------------------------------------------------------

    def _push(self, example: int, offset: int, length: int, piece: int) -> None:
        self._buf.push(example, offset, length, piece)

    # -- rows ---------------------------------------------------------------------------

    def next_plan(self, k: int) -> RowPlan:
        """Up to ``k`` rows as a ``RowPlan``; fewer only at the end of a finite stream."""
        rows, needs_help = self._buf.plan(0, k, True)
        if needs_help:
            return self._plan_with_help(rows, k)
        pieces, row_starts = self._buf.planned(rows)
        return RowPlan(pieces, self.epoch, row_starts)  # one epoch admitted every piece

    def _plan_with_help(self, made: int, k: int) -> RowPlan:
        """``next_plan`` once the kernel has handed back after ``made`` rows: refill in
        Python, let the kernel go on, until ``k`` rows or the end of a finite stream."""
        epochs = [(self.epoch, int(self._buf.row_starts[made]))]  # (epoch, pieces placed)
        while made < k:
            self._refill()
            if not self._buf.state[kernels.N]:
                break  # the end of a finite stream
            rows, _ = self._buf.plan(made, k - made, False)
            made += rows
            epochs.append((self.epoch, int(self._buf.row_starts[made])))
        pieces, row_starts = self._buf.planned(made)
        epoch_of = np.empty(pieces.shape[1], dtype=np.int64)
        first = 0
        for epoch, stop in epochs:
            epoch_of[first:stop] = epoch
            first = stop
        return RowPlan(pieces, epoch_of, row_starts)

    def next_row(self) -> list[Piece] | None:
        """The pieces of the next row, in column order, or ``None`` when a finite
        stream is exhausted."""
        plan = self.next_plan(1)
        return plan[0] if len(plan) else None

    def next_rows(self, k: int) -> list[list[Piece]]:
        """Up to ``k`` rows; fewer only at the end of a finite stream."""
        return self.next_plan(k).rows()

    @property
    def pending_pieces(self) -> int:
        """Pieces admitted but not yet placed in a row (the packer remainder)."""
        return int(self._buf.state[kernels.N])

    def pending(self) -> list[Piece]:
        """The pending pieces in arrival order (each of the current epoch)."""
        arrival, example, offset, length, piece = kernels.pending_columns(self._buf.slots)
        return list(map(Piece, example, offset, length, piece, [self.epoch] * len(piece)))

    # -- state (S2) ---------------------------------------------------------------------

    def snapshot(self) -> PlannerSnapshot:
        """The position now, cheap to take (the buffer's slots copied, nothing built):
        its ``state_dict()`` is what ``state_dict()`` returns now. A loader takes one
        after every batch it prepares (``rows.background``, ``rows.loader_process``)."""
        self._flush()
        return PlannerSnapshot(self.settings(), self.epoch, self.cursor, self._exhausted,
                               self._admitted_this_epoch, self._next_arrival,
                               self._buf.slots.copy(), dataclasses.replace(self._counts))

    def state_dict(self) -> dict:
        """JSON-serialisable position: epoch, cursor, pending pieces, counters."""
        return self.snapshot().state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken. Raises ``ResumeError`` if the
        state belongs to a planner with different settings or data size."""
        self.check_state(state)
        self._start_epoch(int(state["epoch"]))  # pending pieces are all of this epoch
        self.cursor = int(state["cursor"])  # the window is read again from here
        self._exhausted = bool(state["exhausted"])
        self._admitted_this_epoch = int(state["admitted_this_epoch"])
        next_arrival = int(state["next_arrival"])
        if next_arrival >= 1 << ARRIVAL_BITS:
            raise ResumeError(f"packer state has {next_arrival} arrivals, more than "
                              f"2**{ARRIVAL_BITS}; it was not written by this planner")
        pending = sorted(tuple(int(v) for v in p) for p in state["pending"])
        if any(not 1 <= length <= self.seq_len for _, _, _, length, _ in pending):
            raise ResumeError(f"packer state holds a piece longer than the rows of "
                              f"{self.seq_len}; it was not written by this planner")
        self._buf.empty(max(len(pending), self.buffer) + SLACK)
        for arrival, example, offset, length, piece in pending:
            self._buf.state[kernels.NEXT_ARRIVAL] = arrival
            self._push(example, offset, length, piece)
        self._buf.state[kernels.NEXT_ARRIVAL] = next_arrival
        self.counts = PackCounts(**state["counts"])
