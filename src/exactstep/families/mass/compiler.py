"""MASS: rows of text pieces -> encoder-decoder batches (R9; R1, R3, R6-R8, S5).

Each planned piece becomes one segment on each side of a row. Encoder: the piece's
content tokens with one contiguous fragment replaced (mask / random / keep), then
EOS. Decoder: the fragment alone, fed shifted right (``<mask>`` first), labelled with
the fragment, at the fragment's original encoder positions (MASS's compact decoder).
Draws are addressed by the piece alone (S5); ``piece_cost`` keeps rows within both
sides. Design and derivations: docs/design/families.md#familiesmasscompilerpy (R9, S5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.mass.config import MassConfig, row_shape
from exactstep.families.mass.render import render_mass_rows
from exactstep.rows.batch import IGNORE_INDEX, Batch, SourceSide
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, fail_at
from exactstep.rows.packing import Piece
from exactstep.rows.sides import (
    SideArrays,
    check_decoder_shift,
    check_encoder_eos,
    check_source,
    content_tokens,
    segment_edges,
)

MASS_STREAM = 0x4D415353  # "MASS": this family's tag in every piece generator's seed
MASK_NAME = "mask"

#: Encoder actions on fragment tokens (``CompiledPiece.action``); 0 outside the fragment.
NONE, MASK, RANDOM, KEEP = 0, 1, 2, 3


# --------------------------------------------------------------------------- one piece


def piece_generator(seed: int, epoch: int, example_id: int, piece: int) -> np.random.Generator:
    """The generator of one piece's draws, addressed by its identity alone (S5, R9)."""
    return np.random.default_rng([seed, MASS_STREAM, epoch, example_id, piece])


def draw_fragment(r: int, mass: MassConfig, n_content: int,
                  rng: np.random.Generator) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(start u, length k, action [k], random index [k])`` over ``r`` content tokens.

    Draws, in this order and only when ``k >= 1``: ``u = rng.integers(0, r - k + 1)``
    (the uniform start), ``v = rng.random(k)`` (action: mask if ``v < mask_rate``,
    random if ``v < mask_rate + random_rate``, else keep) and ``rng.integers(0,
    n_content, size=k)`` (the random token's index in the content vocabulary, drawn
    for every fragment token whatever its action, so the stream's layout is fixed)."""
    k = mass.fragment_length(r)
    if k == 0:
        return 0, 0, np.zeros(0, dtype=np.int8), np.zeros(0, dtype=np.int64)
    u = int(rng.integers(0, r - k + 1))
    v = rng.random(k)  # [k]
    index = rng.integers(0, n_content, size=k)  # [k]
    action = np.where(v < mass.mask_rate, MASK,
                      np.where(v < mass.mask_rate + mass.random_rate, RANDOM, KEEP))
    return u, k, action.astype(np.int8), index.astype(np.int64)


@dataclass(frozen=True)
class CompiledPiece:
    """One piece masked: ``inputs`` the encoder tokens (``r + 1``, ending with EOS),
    ``start``/``length`` the fragment ``[u, u + k)`` of the content tokens,
    ``targets`` its original tokens, ``action`` per fragment token."""

    example: Example
    piece: Piece
    inputs: np.ndarray  # [r + 1] int64
    start: int
    targets: np.ndarray  # [k] int64
    action: np.ndarray  # [k] int8


# --------------------------------------------------------------------------- the compiler


class MassCompiler:
    """MASS (docs/design/families.md#familiesmasscompilerpy). ``content_ids``: the ids a
    random replacement is drawn from (every non-special id, ascending)."""

    name = "mass"

    def __init__(self, mass: MassConfig, *, seed: int, bos_id: int, eos_id: int, mask_id: int,
                 content_ids: Sequence[int]) -> None:
        content = np.asarray(content_ids, dtype=np.int64)
        if content.size == 0:
            raise ConfigError("MASS needs a non-empty content vocabulary for random tokens")
        self.mass = mass
        self.seed = seed
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.mask_id = mask_id
        self.content = content

    # -- planning

    def capacity(self, cfg: BatchConfig) -> int:
        """Content tokens one row holds: ``seq_len - 1`` (``row_shape``)."""
        return row_shape(self.mass, cfg.seq_len)[0]

    def widths(self, cfg: BatchConfig) -> tuple[int, int]:
        """``(encoder columns, decoder columns)``: ``seq_len`` and a full row's fragment."""
        _, encoder, decoder = row_shape(self.mass, cfg.seq_len)
        return encoder, decoder

    def piece_cost(self, cfg: BatchConfig) -> Callable[[int], int]:
        """A piece of ``length`` tokens is charged ``max(ceil((length + 1) * C / S),
        ceil(d(length) * C / T))`` of the capacity ``C`` (``d`` the decoder length,
        ``S``/``T`` the widths): monotone, ``cost(C) == C``, and pieces whose charges
        sum to at most ``C`` fit both sides."""
        capacity, encoder, decoder = row_shape(self.mass, cfg.seq_len)
        mass = self.mass

        def cost(length: int) -> int:
            return max(-(-(length + 1) * capacity // encoder),
                       -(-mass.decoder_length(length) * capacity // decoder))

        return cost

    # -- compiling

    def mask_piece(self, example: Example, piece: Piece) -> CompiledPiece:
        """The piece's encoder input and fragment, drawn from its own generator."""
        raw = content_tokens(example, piece, self.bos_id, self.eos_id, 'MASS')
        rng = piece_generator(self.seed, piece.epoch, example.example_id, piece.piece)
        u, k, action, index = draw_fragment(len(raw), self.mass, len(self.content), rng)
        fragment = raw[u:u + k]
        shown = np.where(action == MASK, self.mask_id,
                         np.where(action == RANDOM, self.content[index], fragment))
        inputs = np.concatenate([raw[:u], shown, raw[u + k:], [self.eos_id]]).astype(np.int64)
        return CompiledPiece(example, piece, inputs, u, fragment.astype(np.int64), action)

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        """Both sides of ``rows``: per piece one segment on each side (R9). Encoder
        positions per ``cfg.positions``; decoder positions the encoder positions of the
        fragment's tokens. Raises ``BatchInvariantError`` when a row's pieces do not fit
        (rows planned without ``piece_cost``)."""
        encoder, decoder = self.widths(cfg)
        enc = SideArrays(len(rows), encoder, pad_id)
        dec = SideArrays(len(rows), decoder, pad_id, labels=True, weights=weighted)
        for b, row in enumerate(rows):
            for s, p in enumerate(row, start=1):
                item = self.mask_piece(examples[p.example], p)
                n = len(item.inputs)
                first = enc.used[b]
                enc_pos = np.arange(n) if cfg.positions == "reset" else np.arange(first, first + n)
                enc.place(b, s, item, item.inputs, enc_pos)
                k = len(item.targets)
                if k == 0:  # no content: one unsupervised column keeps the pair
                    dec.place(b, s, item, np.array([self.mask_id]), enc_pos[:1],
                              labels=np.array([IGNORE_INDEX]))
                    continue
                shifted = np.concatenate([[self.mask_id], item.targets[:-1]])
                dec.place(b, s, item, shifted, enc_pos[item.start:item.start + k],
                          labels=item.targets)
        source = SourceSide(*enc.tensors()[:3], segments=enc.all_segments())
        input_ids, position_ids, segment_ids, labels, weights = dec.tensors()
        return Batch(input_ids=input_ids, labels=labels, position_ids=position_ids,
                     segment_ids=segment_ids, segments=dec.all_segments(), source=source,
                     weights=weights)

    # -- checking (R7)

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """R7 for MASS rows: the decoder side's ids and labels (``check_batch``; a
        segment's last column is supervised here), the encoder side's shapes, ids and
        pairing, and the rule (R1, R9): each decoder segment starts with ``<mask>``,
        every later input is the previous column's label, every column of a segment
        longer than one is supervised, decoder positions rise by one within a segment,
        and each encoder segment ends with EOS."""
        check_batch(batch, vocab_size, boundary="keep")
        source = batch.source
        if source is None:
            raise BatchInvariantError("a MASS batch has no encoder side (batch.source)")
        check_source(source, batch, vocab_size)
        labels, positions = batch.labels, batch.position_ids
        real, first, follows, last = segment_edges(batch.segment_ids)
        alone = first & last  # a segment of one column may be the unsupervised one
        fail_at(batch, real & ~alone & (labels == IGNORE_INDEX),
                "a decoder column of a fragment has no target (label {value})", labels)
        check_decoder_shift(batch, self.mask_id, "<mask>")
        previous_position = torch.full_like(positions, -2)
        previous_position[:, 1:] = positions[:, :-1]
        fail_at(batch, follows & (positions != previous_position + 1),
                "decoder position {value} does not follow the previous column's: a fragment "
                "is contiguous", positions)
        check_encoder_eos(source, self.eos_id)

    # -- showing (R6)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        """Both sides of each requested row (``exactstep inspect``)."""
        return render_mass_rows(batch, tokenizer, rows)
