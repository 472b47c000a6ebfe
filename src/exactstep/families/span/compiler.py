"""T5 span corruption: rows of text pieces -> encoder-decoder batches (R1, R3, R6-R8).

Each planned piece becomes one segment on each side of a row, as T5's
``span_corruption`` treats a chunk of text: noise spans replaced by sentinels in the
input, the target those spans after their sentinels, the decoder fed the target
shifted right (R1). Draws are addressed by the piece alone (S5), and pieces are
charged so that every row fits both sides (``piece_cost``).
Design and derivations: docs/design/families.md#familiesspancompilerpy (R1, R3, R6-R8, S5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exactstep.errors import BatchInvariantError, ConfigError, DataError
from exactstep.families.span.config import SpanConfig, row_shape
from exactstep.families.span.render import render_span_rows
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, SourceSide
from exactstep.rows.causal import example_weight
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, fail_at
from exactstep.rows.packing import Piece

SPAN_STREAM = 0x5350414E  # "SPAN": this family's tag in every corruption generator's seed
SENTINEL_PREFIX = "extra_id_"


# --------------------------------------------------------------------------- one piece


def piece_generator(seed: int, epoch: int, example_id: int, piece: int) -> np.random.Generator:
    """The generator of one piece's corruption, addressed by its identity alone."""
    return np.random.default_rng([seed, SPAN_STREAM, epoch, example_id, piece])


def segment_lengths(items: int, segments: int, rng: np.random.Generator) -> np.ndarray:
    """T5's ``_random_segmentation``: ``segments`` positive lengths summing to ``items``,
    every composition equally likely. One draw: ``rng.permutation(items - 1)``, whose
    first ``segments - 1`` entries are the gaps cut (gap ``j`` lies after item ``j``)."""
    cuts = np.sort(rng.permutation(items - 1)[: segments - 1]) + 1
    return np.diff(np.concatenate([[0], cuts, [items]]))


def noise_mask(r: int, span: SpanConfig, rng: np.random.Generator) -> np.ndarray:
    """T5's ``random_spans_noise_mask`` over ``r`` raw tokens (bool ``[r]``, True =
    noise): ``K`` noise spans of random lengths summing to ``N`` interleaved with
    ``K`` non-noise spans, non-noise first, so the last raw token is noise. Draws
    nothing below two tokens."""
    noise, spans = span.noise_counts(r)
    if spans == 0:
        return np.zeros(r, dtype=bool)
    noise_lengths = segment_lengths(noise, spans, rng)
    kept_lengths = segment_lengths(r - noise, spans, rng)
    interleaved = np.stack([kept_lengths, noise_lengths], axis=1).reshape(-1)  # [2K]
    return np.repeat(np.tile(np.array([False, True]), spans), interleaved)


def replace_runs(tokens: np.ndarray, marked: np.ndarray, sentinels: np.ndarray) -> np.ndarray:
    """``tokens`` with the ``k``-th run of ``marked`` tokens replaced by ``sentinels[k]``
    (T5's ``noise_span_to_unique_sentinel``)."""
    previous = np.zeros_like(marked)
    previous[1:] = marked[:-1]
    first, later = marked & ~previous, marked & previous
    runs = int(first.sum())
    if runs > len(sentinels):
        raise DataError(f"a piece needs {runs} sentinels but only {len(sentinels)} exist; "
                        "raise span.sentinels")
    if runs == 0:
        return tokens
    run_index = np.maximum(np.cumsum(first) - 1, 0)  # [r] the run each token is in
    return np.where(first, sentinels[run_index], tokens)[~later]


def corrupt(raw: np.ndarray, mask: np.ndarray, sentinels: np.ndarray,
            eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(input, target)`` of raw tokens under a noise mask, each ending with EOS."""
    eos = np.array([eos_id], dtype=np.int64)
    inputs = np.concatenate([replace_runs(raw, mask, sentinels), eos])
    targets = np.concatenate([replace_runs(raw, ~mask, sentinels), eos])
    return inputs, targets


def raw_tokens(example: Example, piece: Piece, bos_id: int, eos_id: int) -> np.ndarray:
    """The piece's tokens without the example's BOS (first token) and EOS (last one).

    Raises ``DataError`` when the example is not ``BOS ... EOS`` text.
    """
    tokens = example.tokens
    n = len(tokens)
    if n < 2 or int(tokens[0]) != bos_id or int(tokens[-1]) != eos_id:
        raise DataError(
            f"example {example.example_id} is not BOS + text + EOS; span corruption reads "
            "text examples (data.kind = 'text')"
        )
    start, stop = max(piece.offset, 1), min(piece.offset + piece.length, n - 1)
    return tokens[start:stop] if stop > start else tokens[:0]


# --------------------------------------------------------------------------- the compiler


@dataclass(frozen=True)
class CompiledPiece:
    """One piece corrupted: encoder tokens and decoder targets (both end with EOS)."""

    example: Example
    piece: Piece
    inputs: np.ndarray  # [f] int64
    targets: np.ndarray  # [g] int64


class SpanCompiler:
    """T5 span corruption (docs/design/families.md#familiesspancompilerpy). ``sentinel_ids[k]``
    is ``extra_id_k``; ``ConfigError`` unless there are ``span.sentinels`` of them."""

    name = "span"

    def __init__(self, span: SpanConfig, *, seed: int, bos_id: int, eos_id: int,
                 sentinel_ids: Sequence[int]) -> None:
        if len(sentinel_ids) != span.sentinels:
            raise ConfigError(f"span.sentinels = {span.sentinels} but {len(sentinel_ids)} "
                              "sentinel ids were given")
        self.span = span
        self.seed = seed
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.sentinels = np.asarray(sentinel_ids, dtype=np.int64)

    # -- planning

    def capacity(self, cfg: BatchConfig) -> int:
        """Raw tokens one row holds: T5's ``tokens_length`` for ``seq_len`` inputs."""
        return row_shape(self.span, cfg.seq_len)[0]

    def widths(self, cfg: BatchConfig) -> tuple[int, int]:
        """``(encoder columns, decoder columns)``: ``seq_len`` and T5's targets length."""
        _, encoder, decoder = row_shape(self.span, cfg.seq_len)
        return encoder, decoder

    def piece_cost(self, cfg: BatchConfig) -> Callable[[int], int]:
        """What a piece of ``length`` tokens is charged of a row's capacity ``C``:
        ``max(ceil(f * C / S), ceil(g * C / T))`` for its input and target lengths
        ``f``, ``g`` and the widths ``S``, ``T``; monotone, ``cost(capacity) ==
        capacity``, and any pieces whose charges sum to at most the capacity fit both
        sides."""
        capacity, encoder, decoder = row_shape(self.span, cfg.seq_len)
        span = self.span

        def cost(length: int) -> int:
            f, g = span.corrupted_lengths(length)
            return max(-(-f * capacity // encoder), -(-g * capacity // decoder))

        return cost

    # -- compiling

    def corrupt_piece(self, example: Example, piece: Piece) -> CompiledPiece:
        """The piece's input and target, drawn from its own generator."""
        raw = raw_tokens(example, piece, self.bos_id, self.eos_id)
        rng = piece_generator(self.seed, piece.epoch, example.example_id, piece.piece)
        inputs, targets = corrupt(raw, noise_mask(len(raw), self.span, rng), self.sentinels,
                                  self.eos_id)
        return CompiledPiece(example, piece, inputs, targets)

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        """Both sides of ``rows``: per piece one segment on each side, the encoder
        holding the corrupted input, the decoder fed the target shifted right (BOS
        first) and labelled with the target (R1). Raises ``BatchInvariantError`` when
        a row's pieces do not fit (rows planned without ``piece_cost``)."""
        encoder, decoder = self.widths(cfg)
        compiled = [[self.corrupt_piece(examples[p.example], p) for p in row] for row in rows]
        enc = SideArrays(len(rows), encoder, pad_id)
        dec = SideArrays(len(rows), decoder, pad_id, labels=True, weights=weighted)
        for b, row in enumerate(compiled):
            for s, item in enumerate(row, start=1):
                enc.place(b, s, item, item.inputs, cfg.positions)
                shifted = np.concatenate([[self.bos_id], item.targets[:-1]])
                dec.place(b, s, item, shifted, cfg.positions, labels=item.targets)
        source = SourceSide(*enc.tensors()[:3], segments=enc.all_segments())
        input_ids, position_ids, segment_ids, labels, weights = dec.tensors()
        return Batch(input_ids=input_ids, labels=labels, position_ids=position_ids,
                     segment_ids=segment_ids, segments=dec.all_segments(), source=source,
                     weights=weights)

    # -- checking (R7)

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """R7 for span rows: the decoder side's ids and labels (``check_batch``; a
        segment's last row is supervised here: its target is the EOS), the encoder
        side's shape and ids, both sides' segments paired (same example and piece), and
        the shift (R1): each decoder segment starts with BOS, every later input is the
        previous column's label, every real column is supervised and the last one's
        label is EOS, and each encoder segment ends with EOS."""
        check_batch(batch, vocab_size, boundary="keep")
        source = batch.source
        if source is None:
            raise BatchInvariantError("a span batch has no encoder side (batch.source)")
        check_source(source, batch, vocab_size)
        inputs, labels, segs = batch.input_ids, batch.labels, batch.segment_ids
        real = segs > 0
        first = real.clone()
        first[:, 1:] &= segs[:, 1:] != segs[:, :-1]
        last = real.clone()
        last[:, :-1] &= segs[:, :-1] != segs[:, 1:]
        fail_at(batch, real & (labels == IGNORE_INDEX),
                "a decoder column of a segment has no target (label {value})", labels)
        fail_at(batch, first & (inputs != self.bos_id),
                "a decoder segment starts with {value}, not the BOS start token", inputs)
        follows = torch.zeros_like(real)
        follows[:, 1:] = real[:, 1:] & ~first[:, 1:]
        previous_label = torch.full_like(labels, IGNORE_INDEX)
        previous_label[:, 1:] = labels[:, :-1]
        fail_at(batch, follows & (inputs != previous_label),
                "decoder input {value} is not the previous column's target: the shift is "
                "missing or doubled", inputs)
        fail_at(batch, last & (labels != self.eos_id),
                "a decoder segment's last target is {value}, not EOS", labels)
        enc_segs = source.segment_ids
        enc_last = enc_segs > 0
        enc_last[:, :-1] &= enc_segs[:, :-1] != enc_segs[:, 1:]
        fail_source_at(source, enc_last & (source.input_ids != self.eos_id),
                       "an encoder segment ends with {value}, not EOS", source.input_ids)

    # -- showing (R6)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        """Both sides of each requested row, sentinels by name (``exactstep inspect``)."""
        return render_span_rows(batch, tokenizer, rows)


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

    def place(self, b: int, s: int, item: CompiledPiece, ids: np.ndarray, positions: str,
              *, labels: np.ndarray | None = None) -> None:
        start, n = self.used[b], len(ids)
        stop = start + n
        if stop > self.width:
            raise BatchInvariantError(
                f"row {b} (example {item.example.example_id}, piece {item.piece.piece}): the "
                f"corrupted pieces take more than the {self.width} columns of a side; plan "
                "span rows with the compiler's piece_cost"
            )
        self.ids[b, start:stop] = ids
        self.positions[b, start:stop] = (np.arange(n) if positions == "reset"
                                         else np.arange(start, stop))
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
