"""The causal-LM compiler: rows of pieces -> a ``Batch`` (R1, R2, R3, R5, R6).

Causal LM and chat SFT rows: the shift happens here, once; labels carry ownership,
segment ids and ``causal`` carry visibility (R2); positions and boundary targets
follow ``batch.positions`` and ``batch.boundary`` (R3). Two builders, one semantics:
the kernel over prepared shards, NumPy for everything else.
Design and derivations: docs/design/rows.md#rowscausalpy (R1-R3, R5-R7, L3).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from exactstep.errors import DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece, RowPlan


def compile_causal_batch(
    rows: Sequence[Sequence[Piece]],
    examples: Sequence[Example],
    *,
    seq_len: int,
    pad_id: int,
    boundary: str = "ignore",
    positions: str = "reset",
    weighted: bool = False,
) -> Batch:
    """One ``Batch`` of ``len(rows)`` rows x ``seq_len`` columns.

    A column's label is the next token of its segment when that token is an owned
    target, else ``IGNORE_INDEX`` (R1, R5); a segment's last column is
    ``IGNORE_INDEX`` under ``boundary = "ignore"`` and, under ``"keep"``, the next
    segment's first token when one follows (R3). Positions restart per segment
    (``"reset"``) or follow the column (``"continue"``); padding is ``pad_id``,
    ``IGNORE_INDEX``, position 0, segment 0. The rules in full:
    docs/design/rows.md#rowscausalpy.

    With ``weighted`` the batch carries ``weights`` [B, T] float32 from the examples'
    ``weight``; an example without one then raises ``DataError``.

    Built over the whole batch at once: the batch read row-major is its pieces'
    tokens back to back, each row closed by its padding, so every array is one
    concatenation (or repeat) over ``B * T`` slots, and each label is the next
    slot's input, set to ``IGNORE_INDEX`` where the rules above say so.
    """
    shard_maps = None if weighted or not isinstance(rows, RowPlan) else kernel_maps(examples)
    if shard_maps is not None:
        return compile_plan(rows, shard_maps, seq_len=seq_len, pad_id=pad_id,
                            boundary=boundary, positions=positions)
    n_rows = len(rows)
    pieces = [piece for row in rows for piece in row]
    tokens, owned, ids = piece_slices(examples, pieces)
    layout = Layout(rows, ids, seq_len)
    slots = n_rows * seq_len
    ramp = np.arange(seq_len, dtype=np.int64)  # [T]
    zeros = np.zeros(seq_len, dtype=np.int64)
    pad = np.full(seq_len, pad_id, dtype=np.int64)
    input_ids = concat(layout.fill(tokens, pad), np.int64, slots)  # [B*T]
    labels = np.empty(slots, dtype=np.int64)  # [B*T] the next slot's input ...
    labels[:-1] = input_ids[1:]
    labels[-1:] = IGNORE_INDEX
    if owned is not None:  # ... where that token is an owned target (R5)
        owner = concat(layout.fill(owned, np.zeros(seq_len, dtype=bool)), np.bool_, slots)
        labels[:-1][~owner[1:]] = IGNORE_INDEX
    ends = np.asarray(layout.ends, dtype=np.int64)  # [P] one past each piece's last slot
    followed = np.asarray(layout.followed, dtype=bool)  # [P] another segment follows
    if boundary == "keep":
        kept = ends[followed] - 1
        labels[kept] = input_ids[kept + 1]  # the next segment's first token, owned or not
        labels[ends[~followed] - 1] = IGNORE_INDEX
    else:
        labels[ends - 1] = IGNORE_INDEX  # no target crosses a boundary (R3)
    for first, stop in layout.padding:
        labels[first:stop] = IGNORE_INDEX
    if positions == "reset":
        position_ids = concat([(ramp if number else zeros)[:n]
                               for n, number in zip(layout.lengths, layout.numbers, strict=True)],
                              np.int64, slots)
    else:
        position_ids = concat([part for used in layout.used
                               for part in (ramp[:used], zeros[: seq_len - used])],
                              np.int64, slots)
    segment_ids = np.repeat(np.asarray(layout.numbers, dtype=np.int32),
                            layout.lengths)  # [B*T]
    weights = None
    if weighted:
        per_piece = iter([example_weight(examples[p.example]) for p in pieces])
        values = [next(per_piece) if number else 0.0 for number in layout.numbers]
        weights = np.repeat(np.asarray(values, dtype=np.float32), layout.lengths)
    shape = (n_rows, seq_len)
    return Batch(
        input_ids=torch.from_numpy(input_ids.reshape(shape)),
        labels=torch.from_numpy(labels.reshape(shape)),
        position_ids=torch.from_numpy(position_ids.reshape(shape)),
        segment_ids=torch.from_numpy(segment_ids.reshape(shape)),
        segments=layout.segments,
        weights=None if weights is None else torch.from_numpy(weights.reshape(shape)),
    )


def causal_screened(
    examples: Sequence[Example],
    *,
    seq_len: int,
    pad_id: int,
    boundary: str,
    positions: str,
    weighted: bool,
    screen: tuple[int, bool, bool] | None,
) -> Callable[[Sequence[Sequence[Piece]]], tuple[Batch, bool, int]]:
    """``compile_causal_batch`` over one stream's ``examples`` and settings, as a
    function of the rows that also says whether the R7 screen with the settings
    ``screen`` (``rows.invariants.screen_settings``; ``None``: no screen) cleared the
    batch, and counts its supervised labels (``Batch.num_targets``): ``rows ->
    (batch, clean, count)``. A ``RowPlan`` over prepared shards is filled, screened
    and counted in one kernel call (the kernel for these settings is found here,
    once); any other batch is not screened (``False``: the caller checks it) and is
    counted after it is built."""
    maps = None if weighted else kernel_maps(examples)
    fill = None if maps is None else maps.causal_fill(
        seq_len, pad_id, boundary == "keep", positions == "reset", screen)

    def screened(rows: Sequence[Sequence[Piece]]) -> tuple[Batch, bool, int]:
        if fill is not None and isinstance(rows, RowPlan):
            return filled_batch(fill, rows)
        batch = compile_causal_batch(rows, examples, seq_len=seq_len, pad_id=pad_id,
                                     boundary=boundary, positions=positions,
                                     weighted=weighted)
        return batch, False, batch.num_targets()

    return screened


def kernel_maps(examples: Sequence[Example]):
    """The shard maps the causal kernel reads ``examples`` from
    (``rows.prepared.ShardMaps``), or ``None`` when the NumPy builder compiles them
    (examples that are not prepared shards the kernel reads)."""
    maps = getattr(examples, "kernel_maps", None)
    return None if maps is None else maps()


def compile_plan(plan: RowPlan, maps, *, seq_len: int, pad_id: int, boundary: str,
                 positions: str) -> Batch:
    """``compile_causal_batch`` of ``plan`` over prepared shards' memory maps
    (``maps``: ``rows.prepared.ShardMaps``), by the causal kernel; raises
    ``IndexError`` for a piece outside its document (or an index entry outside its
    shard), as slicing it would."""
    fill = maps.causal_fill(seq_len, pad_id, boundary == "keep", positions == "reset", None)
    return filled_batch(fill, plan)[0]


def filled_batch(fill, plan: RowPlan) -> tuple[Batch, bool, int]:
    """``(batch, clean, count)`` of ``plan`` by the kernel ``fill``
    (``rows.kernels.CausalFill``); ``IndexError`` as ``compile_plan`` raises."""
    (input_ids, labels, position_ids, segment_ids), bad, clean, count, segments = fill(
        plan.pieces, plan.row_starts, Segment)  # the segments as plan_segments builds them
    if bad >= 0:
        raise IndexError(f"piece {plan.pieces[:4, bad].tolist()} (example, offset, length, "
                         "piece) lies outside its document")
    batch = Batch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        segments=segments,
    )
    return batch, clean, count


class Layout:
    """Where a batch's pieces sit among its ``B * T`` slots (row-major).

    ``segments``: each row's ``Segment`` addresses (R6). ``lengths`` / ``numbers``:
    the runs of slots in order -- each piece (segment number 1, 2, ... in its row)
    and each row's padding (number 0, only where the row is not full). ``ends``: one
    past each piece's last slot; ``followed``: whether another segment follows it in
    its row; ``used``: each row's filled columns; ``padding``: ``(first, stop)`` slots
    of each row's padding. Raises ``ValueError`` for a row longer than ``seq_len``.
    """

    def __init__(self, rows: Sequence[Sequence[Piece]], ids: list[int], seq_len: int) -> None:
        self.lengths: list[int] = []
        self.numbers: list[int] = []
        self.ends: list[int] = []
        self.followed: list[bool] = []
        self.used: list[int] = []
        self.padding: list[tuple[int, int]] = []
        segments = []
        k = 0
        for r, row in enumerate(rows):
            base, start, row_segments = r * seq_len, 0, []
            for s, piece in enumerate(row, start=1):
                row_segments.append(Segment(ids[k], piece.piece, piece.offset, start,
                                            piece.length))
                start += piece.length
                self.lengths.append(piece.length)
                self.numbers.append(s)
                self.ends.append(base + start)
                self.followed.append(s < len(row))
                k += 1
            if start > seq_len:
                raise ValueError(f"row {r} holds {start} tokens, more than seq_len = {seq_len}")
            if start < seq_len:
                self.lengths.append(seq_len - start)
                self.numbers.append(0)
                self.padding.append((base + start, base + seq_len))
            self.used.append(start)
            segments.append(tuple(row_segments))
        self.segments = tuple(segments)

    def fill(self, parts: list[np.ndarray], padding: np.ndarray) -> list[np.ndarray]:
        """``parts`` (one per piece, in order) with each row's padding slice put in."""
        out: list[np.ndarray] = []
        it = iter(parts)
        for length, number in zip(self.lengths, self.numbers, strict=True):
            out.append(next(it) if number else padding[:length])
        return out


def concat(parts: list[np.ndarray], dtype, slots: int) -> np.ndarray:
    """``parts`` back to back as ``dtype`` (``slots`` of them; none when no rows),
    cast as assigning them into a ``dtype`` array would."""
    if not parts:
        return np.zeros(slots, dtype=dtype)
    return np.concatenate(parts, dtype=dtype, casting="unsafe")


def piece_slices(
    examples: Sequence[Example], pieces: Sequence[Piece]
) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[int]]:
    """Each piece's tokens, its ownership (bool; ``None`` when every example owns all
    its tokens but the first, i.e. text) and its ``example_id``. A table with
    ``piece_slices`` (prepared shards, ``rows.prepared``) reads them itself; a list
    of examples is sliced here. Raises ``ValueError`` for a piece past its example."""
    own = getattr(examples, "piece_slices", None)
    if own is not None:
        return own(pieces)
    chosen = [examples[p.example] for p in pieces]
    tokens = []
    for e, p in zip(chosen, pieces, strict=True):
        part = e.tokens[p.offset: p.offset + p.length]
        if len(part) != p.length:
            raise ValueError(f"piece {p} reaches past the end of example {e.example_id}")
        tokens.append(part)
    owned = None
    if any(e.owned is not None for e in chosen):
        owned = [np.ones(p.length, dtype=bool) if e.owned is None
                 else e.owned[p.offset: p.offset + p.length]
                 for e, p in zip(chosen, pieces, strict=True)]
    return tokens, owned, [e.example_id for e in chosen]


def example_weight(example: Example) -> float:
    """The example's L3 weight; ``DataError`` when a weighted batch meets one without."""
    if example.weight is None:
        raise DataError(
            f"example {example.example_id} has no \"weight\" but the batch is weighted; "
            'give every example a "weight" (objective.reduction = weighted*)'
        )
    return example.weight
