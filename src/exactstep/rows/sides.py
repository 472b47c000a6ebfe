"""The two sides of an encoder-decoder batch being filled (R6-R8), for the compilers
that corrupt text into a source and a target (span, MASS, BART).

``content_tokens`` is a text piece without its example's ``BOS`` and ``EOS``;
``SideArrays`` fills one side's rows piece by piece (ids, positions, segments,
labels, weights) and hands them to torch; ``check_source`` and ``fail_source_at``
check an encoder side and its pairing with the decoder side, naming the row, column
and piece of the first fault.
Design and derivations: docs/design/rows.md#rowssidespy (R6-R8).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from exactstep.errors import BatchInvariantError, DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, SourceSide
from exactstep.rows.causal import example_weight
from exactstep.rows.example import Example
from exactstep.rows.invariants import fail_at
from exactstep.rows.packing import Piece


def content_tokens(example: Example, piece: Piece, bos_id: int, eos_id: int,
                   reader: str) -> np.ndarray:
    """The piece's tokens without the example's BOS (first token) and EOS (last one).

    Raises ``DataError`` (naming ``reader``, the family) when the example is not
    ``BOS ... EOS`` text.
    """
    tokens = example.tokens
    n = len(tokens)
    if n < 2 or int(tokens[0]) != bos_id or int(tokens[-1]) != eos_id:
        raise DataError(
            f"example {example.example_id} is not BOS + text + EOS; {reader} reads "
            "text examples (data.kind = 'text')"
        )
    start, stop = max(piece.offset, 1), min(piece.offset + piece.length, n - 1)
    return tokens[start:stop] if stop > start else tokens[:0]


class SideArrays:
    """The arrays of one side of a batch being filled (NumPy, handed to torch)."""

    def __init__(self, rows: int, width: int, pad_id: int, *, labels: bool = False,
                 weights: bool = False) -> None:
        self.width = width
        self.ids = np.full((rows, width), pad_id, dtype=np.int64)  # [B, W]
        self.positions = np.zeros((rows, width), dtype=np.int64)  # [B, W]
        self.segment_ids = np.zeros((rows, width), dtype=np.int32)  # [B, W]
        self.labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64) if labels else None
        self.weights = np.zeros((rows, width), dtype=np.float32) if weights else None
        self.segments: list[list[Segment]] = [[] for _ in range(rows)]
        self.used = [0] * rows

    def place(self, b: int, s: int, item: Any, ids: np.ndarray,
              positions: str | np.ndarray, *, labels: np.ndarray | None = None) -> None:
        """Put ``ids`` for ``item`` (its ``example`` and ``piece``) as segment ``s`` of
        row ``b``; ``positions``: ``"reset"`` (from 0), ``"continue"`` (the row's
        columns) or the positions themselves."""
        start, n = self.used[b], len(ids)
        stop = start + n
        if stop > self.width:
            raise BatchInvariantError(
                f"row {b} (example {item.example.example_id}, piece {item.piece.piece}): the "
                f"compiled pieces take more than the {self.width} columns of a side; plan "
                "the rows with the compiler's piece_cost"
            )
        self.ids[b, start:stop] = ids
        if isinstance(positions, str):
            positions = np.arange(n) if positions == "reset" else np.arange(start, stop)
        self.positions[b, start:stop] = positions
        self.segment_ids[b, start:stop] = s
        if self.labels is not None and labels is not None:
            self.labels[b, start:stop] = labels
        if self.weights is not None:
            self.weights[b, start:stop] = example_weight(item.example)
        self.segments[b].append(Segment(item.example.example_id, item.piece.piece,
                                        item.piece.offset, start, n))
        self.used[b] = stop

    def all_segments(self) -> tuple[tuple[Segment, ...], ...]:
        return tuple(tuple(row) for row in self.segments)

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """``(ids, positions, segment ids, labels, weights)``; the last two may be None."""
        def wrap(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a)

        return (wrap(self.ids), wrap(self.positions), wrap(self.segment_ids),
                wrap(self.labels), wrap(self.weights))


def check_source(source: SourceSide, batch: Batch, vocab_size: int | None) -> None:
    """The encoder side's shapes, ids and pairing with the decoder side (R7, R8)."""
    rows = batch.shape[0]
    for name in ("input_ids", "position_ids", "segment_ids"):
        shape = tuple(getattr(source, name).shape)
        if len(shape) != 2 or shape[0] != rows or 0 in shape:
            raise BatchInvariantError(f"source.{name} has shape {shape}; expected "
                                      f"[{rows}, S > 0] like the decoder side's rows")
    if tuple(source.position_ids.shape) != source.shape or \
            tuple(source.segment_ids.shape) != source.shape:
        raise BatchInvariantError("the encoder side's tensors differ in shape")
    ids = source.input_ids
    bad = (ids < 0) if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    fail_source_at(source, bad, "encoder input id {value} is outside the vocabulary", ids)
    if len(source.segments) != rows:
        raise BatchInvariantError(f"the encoder side lists {len(source.segments)} rows of "
                                  f"segments, the decoder side {rows}")
    for b, (dec, enc) in enumerate(zip(batch.segments, source.segments, strict=True)):
        pairs = [(d.example_id, d.piece) for d in dec]
        if pairs != [(e.example_id, e.piece) for e in enc]:
            raise BatchInvariantError(
                f"row {b}: decoder segments {pairs} are not paired with the encoder's "
                f"{[(e.example_id, e.piece) for e in enc]} (segment s must be the same piece)"
            )


def fail_source_at(source: SourceSide, bad: torch.Tensor, what: str,
                   values: torch.Tensor) -> None:
    """``fail_at`` for the encoder side: names the row, column and piece."""
    if not bool(bad.any()):
        return
    flat = int(torch.nonzero(bad.reshape(-1))[0, 0])
    b, i = divmod(flat, bad.shape[1])
    piece = next((f"example {s.example_id}, piece {s.piece}" for s in source.segments[b]
                  if s.start <= i < s.stop), "padding")
    raise BatchInvariantError(f"encoder row {b} column {i} ({piece}): "
                              f"{what.format(value=int(values[b, i]))}")


def segment_edges(segment_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(real, first, follows, last)`` ``[B, T]`` bool: a segment's columns, its first,
    the ones after its first, its last."""
    real = segment_ids > 0
    first = real.clone()
    first[:, 1:] &= segment_ids[:, 1:] != segment_ids[:, :-1]
    follows = torch.zeros_like(real)
    follows[:, 1:] = real[:, 1:] & ~first[:, 1:]
    last = real.clone()
    last[:, :-1] &= segment_ids[:, :-1] != segment_ids[:, 1:]
    return real, first, follows, last


def check_decoder_shift(batch: Batch, start_id: int, start_name: str) -> None:
    """Each decoder segment starts with ``start_id`` and every later input is the
    previous column's label (R1: the shift, once)."""
    inputs, labels = batch.input_ids, batch.labels
    _, first, follows, _ = segment_edges(batch.segment_ids)
    fail_at(batch, first & (inputs != start_id),
            f"a decoder segment starts with {{value}}, not the {start_name} start token", inputs)
    previous_label = torch.full_like(labels, IGNORE_INDEX)
    previous_label[:, 1:] = labels[:, :-1]
    fail_at(batch, follows & (inputs != previous_label),
            "decoder input {value} is not the previous column's target: the shift is "
            "missing or doubled", inputs)


def check_encoder_eos(source: SourceSide, eos_id: int) -> None:
    """Each encoder segment ends with EOS."""
    _, _, _, last = segment_edges(source.segment_ids)
    fail_source_at(source, last & (source.input_ids != eos_id),
                   "an encoder segment ends with {value}, not EOS", source.input_ids)


def teacher_forced_pairs(compiled: Sequence[Sequence[Any]], encoder: int, decoder: int, *,
                         pad_id: int, weighted: bool, positions: str,
                         start_id: int) -> Batch:
    """The batch of rows of compiled pieces (each with ``inputs`` and ``targets``, both
    ending with EOS): per piece one segment on each side, the encoder holding
    ``inputs``, the decoder fed ``start_id`` and the targets shifted right and labelled
    with the targets (R1). ``BatchInvariantError`` when a row's pieces do not fit."""
    enc = SideArrays(len(compiled), encoder, pad_id)
    dec = SideArrays(len(compiled), decoder, pad_id, labels=True, weights=weighted)
    for b, row in enumerate(compiled):
        for s, item in enumerate(row, start=1):
            enc.place(b, s, item, item.inputs, positions)
            shifted = np.concatenate([[start_id], item.targets[:-1]])
            dec.place(b, s, item, shifted, positions, labels=item.targets)
    source = SourceSide(*enc.tensors()[:3], segments=enc.all_segments())
    input_ids, position_ids, segment_ids, labels, weights = dec.tensors()
    return Batch(input_ids=input_ids, labels=labels, position_ids=position_ids,
                 segment_ids=segment_ids, segments=dec.all_segments(), source=source,
                 weights=weights)
