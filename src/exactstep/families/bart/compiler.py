"""BART denoising: rows of text pieces -> encoder-decoder batches (R1, R3, R6, R7, R9).

Each planned piece becomes one segment on each side of a row: the encoder reads the
piece's raw tokens after the declared composition of noising functions (``[bart]
noise``, in order), the decoder reconstructs the original piece, fed it shifted
right behind BOS (R1). One generator per piece, addressed by the piece alone, is
consumed by the functions in composition order (R9, S5).
Design and derivations: docs/design/families.md#familiesbartcompilerpy (R1, R3, R6, R7, R9).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from exactstep.errors import BatchInvariantError
from exactstep.families.bart.config import BartConfig, row_shape
from exactstep.families.bart.render import render_bart_rows
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

BART_STREAM = 0x42415254  # "BART": this family's tag in every noising generator's seed
MASK_NAME = "mask"
#: The byte tokenizer's sentence splitter (R9): a sentence ends after a newline, or
#: after one of these punctuation bytes followed by a space.
NEWLINE, SPACE = 0x0A, 0x20
PUNCTUATION = (ord("."), ord("!"), ord("?"))


# --------------------------------------------------------------------------- one piece


def piece_generator(seed: int, epoch: int, example_id: int, piece: int) -> np.random.Generator:
    """The generator of one piece's noise, addressed by its identity alone (R9)."""
    return np.random.default_rng([seed, BART_STREAM, epoch, example_id, piece])


def token_masking(x: np.ndarray, rate: float, rng: np.random.Generator,
                  mask_id: int) -> np.ndarray:
    """Each token replaced by ``mask_id`` where its uniform draw is below ``rate``
    (one ``rng.random(n)``); the length is kept."""
    return np.where(rng.random(len(x)) < rate, mask_id, x)


def token_deletion(x: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Each token deleted where its uniform draw is below ``rate`` (one
    ``rng.random(n)``); what is left is a subsequence, in order."""
    return x[~(rng.random(len(x)) < rate)]


def infilling_budget(n: int, rate: float) -> int:
    """``ceil(rate * n)`` computed exactly with ``rate`` read as the decimal it is written
    as (its shortest ``repr``): ``0.07 * 100`` is 7 here, 8 in float arithmetic."""
    return math.ceil(Fraction(repr(rate)) * n)


def infilling_spans(n: int, rate: float, lam: float,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths [k], slots [k])`` of text infilling over ``n`` tokens.

    ``N = ceil(rate * n)`` tokens are covered (``infilling_budget``). Lengths are
    drawn ``rng.poisson(lam, N)`` at a time until they sum to at least ``N``; the first
    length that reaches ``N`` is cut to fit and the rest dropped (fairseq's budget).
    Zero-length spans beyond ``N - (positive spans)`` are dropped, earliest kept, so
    ``k <= N`` and the piece never grows. Then ``rng.permutation(n - N + k)[:k]``:
    span ``j`` takes output slot ``slots[j]``, the kept tokens the other slots, in
    order. Nothing is drawn when ``N == 0``.
    """
    budget = infilling_budget(n, rate)
    if budget == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lengths = rng.poisson(lam, size=budget)
    while int(lengths.sum()) < budget:
        lengths = np.concatenate([lengths, rng.poisson(lam, size=budget)])
    cum = np.cumsum(lengths)
    last = int(np.searchsorted(cum, budget))  # the first length that reaches the budget
    lengths = lengths[: last + 1].astype(np.int64)
    lengths[last] = budget - (int(cum[last - 1]) if last else 0)
    zero = lengths == 0
    room = budget - int((~zero).sum())
    lengths = lengths[~zero | (np.cumsum(zero) <= room)]
    k = len(lengths)
    slots = rng.permutation(n - budget + k)[:k]
    return lengths, slots


def infill(x: np.ndarray, lengths: np.ndarray, slots: np.ndarray, mask_id: int) -> np.ndarray:
    """``x`` with span ``j`` (``lengths[j]`` tokens) replaced by one ``mask_id`` at output
    slot ``slots[j]``; the other slots take the uncovered tokens in order."""
    width = len(x) - int(lengths.sum()) + len(lengths)
    is_span = np.zeros(width, dtype=bool)
    is_span[slots] = True
    consumed = np.ones(width, dtype=np.int64)
    consumed[slots] = lengths
    source = np.cumsum(consumed) - consumed  # [width] the first token each slot reads
    kept = x[np.minimum(source, max(len(x) - 1, 0))] if len(x) else np.zeros(width, x.dtype)
    return np.where(is_span, mask_id, kept).astype(x.dtype)


def text_infilling(x: np.ndarray, rate: float, lam: float, rng: np.random.Generator,
                   mask_id: int) -> np.ndarray:
    """BART's text infilling (``infilling_spans`` then ``infill``)."""
    lengths, slots = infilling_spans(len(x), rate, lam, rng)
    return infill(x, lengths, slots, mask_id) if len(lengths) else x


def sentence_bounds(x: np.ndarray) -> list[int]:
    """The end (exclusive) of each sentence of ``x``, the last being ``len(x)``: a
    sentence ends after a newline byte or after ``.``/``!``/``?`` and a space. An
    empty ``x`` has no sentence."""
    ends = set((np.flatnonzero(x == NEWLINE) + 1).tolist())
    if len(x) > 1:
        ends |= set((np.flatnonzero(np.isin(x[:-1], PUNCTUATION) & (x[1:] == SPACE))
                     + 2).tolist())
    if len(x):
        ends.add(len(x))
    return sorted(ends)


def sentence_permutation(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The sentences of ``x`` in the order of one ``rng.permutation(sentences)``:
    output sentence ``i`` is input sentence ``order[i]``."""
    bounds = sentence_bounds(x)
    starts = [0, *bounds[:-1]]
    order = rng.permutation(len(bounds))
    if len(bounds) == 0:
        return x
    return np.concatenate([x[starts[i]:bounds[i]] for i in order])


def document_rotation(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x`` rotated so that token ``rng.integers(n)`` comes first; an empty ``x``
    draws nothing."""
    if len(x) == 0:
        return x
    start = int(rng.integers(len(x)))
    return np.concatenate([x[start:], x[:start]])


def noise(x: np.ndarray, bart: BartConfig, rng: np.random.Generator, mask_id: int) -> np.ndarray:
    """The declared composition (``bart.noise``, left to right) applied to ``x``, every
    function drawing from the one generator in turn (R9)."""
    for name in bart.noise:
        if name == "token_masking":
            x = token_masking(x, bart.token_masking_rate, rng, mask_id)
        elif name == "token_deletion":
            x = token_deletion(x, bart.token_deletion_rate, rng)
        elif name == "text_infilling":
            x = text_infilling(x, bart.text_infilling_rate, bart.poisson_lambda, rng, mask_id)
        elif name == "sentence_permutation":
            x = sentence_permutation(x, rng)
        else:  # document_rotation (BartConfig refuses any other name)
            x = document_rotation(x, rng)
    return x


# --------------------------------------------------------------------------- the compiler


@dataclass(frozen=True)
class CompiledPiece:
    """One piece noised: encoder tokens and decoder targets (both end with EOS)."""

    example: Example
    piece: Piece
    inputs: np.ndarray  # [f] int64: noised raw tokens + EOS
    targets: np.ndarray  # [g] int64: original raw tokens + EOS


class BartCompiler:
    """BART denoising (docs/design/families.md#familiesbartcompilerpy): the original
    piece reconstructed from its noised copy (R9)."""

    name = "bart"

    def __init__(self, bart: BartConfig, *, seed: int, bos_id: int, eos_id: int,
                 mask_id: int) -> None:
        self.bart = bart
        self.seed = seed
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.mask_id = mask_id

    # -- planning

    def capacity(self, cfg: BatchConfig) -> int:
        """Planner tokens one row holds: ``seq_len - 1`` (``row_shape``)."""
        return row_shape(cfg.seq_len)[0]

    def widths(self, cfg: BatchConfig) -> tuple[int, int]:
        """``(encoder columns, decoder columns)``: ``seq_len`` each."""
        _, encoder, decoder = row_shape(cfg.seq_len)
        return encoder, decoder

    def piece_cost(self, cfg: BatchConfig) -> Callable[[int], int]:
        """A piece of ``l`` tokens takes at most ``l + 1`` columns of either side
        (``encoded_bound``); it is charged ``ceil((l + 1) * C / S)`` of the capacity
        ``C = S - 1``: monotone, ``cost(C) == C``, and pieces whose charges sum to at
        most ``C`` take at most ``S`` columns on each side."""
        capacity, width, _ = row_shape(cfg.seq_len)
        return lambda length: -(-(length + 1) * capacity // width)

    # -- compiling

    def noise_piece(self, example: Example, piece: Piece) -> CompiledPiece:
        """The piece's noised input and original target, drawn from its own generator."""
        raw = content_tokens(example, piece, self.bos_id, self.eos_id, 'BART denoising')
        rng = piece_generator(self.seed, piece.epoch, example.example_id, piece.piece)
        eos = np.array([self.eos_id], dtype=np.int64)
        noised = noise(raw.astype(np.int64), self.bart, rng, self.mask_id)
        return CompiledPiece(example, piece, np.concatenate([noised, eos]),
                             np.concatenate([raw.astype(np.int64), eos]))

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
        holding the noised piece and EOS, the decoder fed BOS and the original piece and
        labelled with the original piece and EOS (R1). Raises ``BatchInvariantError``
        when a row's pieces do not fit (rows planned without ``piece_cost``)."""
        encoder, decoder = self.widths(cfg)
        compiled = [[self.noise_piece(examples[p.example], p) for p in row] for row in rows]
        return teacher_forced_pairs(compiled, encoder, decoder, pad_id=pad_id,
                                    weighted=weighted, positions=cfg.positions,
                                    start_id=self.bos_id)

    # -- checking (R7)

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """R7 for BART rows: the decoder side's ids and labels (``check_batch``), the
        encoder side's shape, ids and pairing (``check_source``), and the shift (R1):
        each decoder segment starts with BOS, every later input is the previous
        column's label, every real column is supervised, the last label is EOS and no
        label is ``<mask>`` (the target is the original text); each encoder segment
        ends with EOS."""
        check_batch(batch, vocab_size, boundary="keep")
        source = batch.source
        if source is None:
            raise BatchInvariantError("a BART batch has no encoder side (batch.source)")
        check_source(source, batch, vocab_size)
        labels = batch.labels
        real, _, _, last = segment_edges(batch.segment_ids)
        fail_at(batch, real & (labels == IGNORE_INDEX),
                "a decoder column of a segment has no target (label {value})", labels)
        fail_at(batch, labels == self.mask_id,
                "a decoder target is {value}, the <mask> token: the target must be the "
                "original text", labels)
        check_decoder_shift(batch, self.bos_id, "BOS")
        fail_at(batch, last & (labels != self.eos_id),
                "a decoder segment's last target is {value}, not EOS", labels)
        check_encoder_eos(source, self.eos_id)

    # -- showing (R6)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        """Source, decoder input and owned target of each requested row
        (``exactstep inspect``)."""
        return render_bart_rows(batch, tokenizer, rows)
