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

from exactstep.errors import BatchInvariantError, ConfigError, DataError
from exactstep.families.span.config import SpanConfig, row_shape
from exactstep.families.span.render import render_span_rows
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, fail_at
from exactstep.rows.packing import Piece
from exactstep.rows.sides import (
    check_decoder_shift,
    check_encoder_eos,
    check_source,
    content_tokens,
    segment_edges,
    teacher_forced_pairs,
)

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
        raw = content_tokens(example, piece, self.bos_id, self.eos_id, 'span corruption')
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
        return teacher_forced_pairs(compiled, encoder, decoder, pad_id=pad_id,
                                    weighted=weighted, positions=cfg.positions,
                                    start_id=self.bos_id)

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
        labels = batch.labels
        real, _, _, last = segment_edges(batch.segment_ids)
        fail_at(batch, real & (labels == IGNORE_INDEX),
                "a decoder column of a segment has no target (label {value})", labels)
        check_decoder_shift(batch, self.bos_id, "BOS")
        fail_at(batch, last & (labels != self.eos_id),
                "a decoder segment's last target is {value}, not EOS", labels)
        check_encoder_eos(source, self.eos_id)

    # -- showing (R6)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        """Both sides of each requested row, sentinels by name (``exactstep inspect``)."""
        return render_span_rows(batch, tokenizer, rows)
