"""The masked-LM (BERT) family: compiler, R7 checks, rows view and score (R8).

Each packed piece is corrupted on its own (BERT's fixed count and 80/10/10, over
non-special tokens) from a generator addressed by the piece alone, so packing,
sharding and resume never change it (S5); the targets are the original tokens at the
selected columns, with no shift, and a column sees only its own segment (R2, R3).
Design and derivations: docs/design/families.md#familiesmlmcompilerpy (R8, R2, R3, R7, S5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.mlm.config import MLMConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.causal import example_weight
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.inspect import NO_TARGET, TokenizerLike, token_label, visible_span
from exactstep.rows.invariants import check_batch, fail_at
from exactstep.rows.packing import Piece

#: The first word of every masked-LM generator address ("mlm" in ASCII), so its
#: draws are not those of another family addressed by the same piece.
MLM_STREAM = 0x6D6C6D

#: Per-column corruption actions in ``MaskRecord.action``.
NONE, MASK, RANDOM, KEEP = 0, 1, 2, 3
ACTION_NAMES = {NONE: "", MASK: "mask", RANDOM: "random", KEEP: "keep"}


def selection_count(eligible: int, rate: float) -> int:
    """How many of ``eligible`` positions one piece selects: 0 when none, else
    ``max(1, floor(rate * eligible + 0.5))`` (step 2 of
    docs/design/families.md#familiesmlmcompilerpy)."""
    if eligible == 0:
        return 0
    return max(1, math.floor(rate * eligible + 0.5))


def piece_generator(seed: int, epoch: int, example_id: int, piece: int) -> np.random.Generator:
    """The generator of one piece's draws (step 3 of the rule): its own stream, never
    shared."""
    return np.random.default_rng([MLM_STREAM, seed, epoch, example_id, piece])


@dataclass(frozen=True)
class Vocabulary:
    """What the rule needs from the tokenizer: the special ids (never eligible, never a
    random replacement), the non-special ids (ascending) and the mask id."""

    special: np.ndarray  # [n_special] int64
    normal: np.ndarray  # [n_normal] int64, ascending
    mask_id: int

    @classmethod
    def of(cls, tokenizer: Any) -> Vocabulary:
        """From a tokenizer with ``special_ids()``, ``vocab_size`` and a ``"mask"`` special."""
        specials = tokenizer.special_ids()
        if "mask" not in specials:
            raise ConfigError("objective.family = 'mlm' needs the byte tokenizer's 'mask' "
                              "special token; set data.tokenizer = 'bytes'")
        special = np.array(sorted(set(specials.values())), dtype=np.int64)
        normal = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), special)
        return cls(special=special, normal=normal, mask_id=int(specials["mask"]))


def corrupt_piece(
    tokens: np.ndarray, rng: np.random.Generator, settings: MLMConfig, vocab: Vocabulary
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs [n], action [n] int8)`` of one piece under the corruption rule
    (steps 1-5 of docs/design/families.md#familiesmlmcompilerpy)."""
    eligible = np.flatnonzero(~np.isin(tokens, vocab.special))  # [m] columns
    k = selection_count(eligible.size, settings.mask_rate)
    u = rng.random(eligible.size)  # [m]
    v = rng.random(k)  # [k]
    r = rng.integers(0, vocab.normal.size, size=k)  # [k]
    chosen = np.sort(eligible[np.argsort(u, kind="stable")[:k]])  # [k] column order
    acts = np.where(v < settings.replace_mask, MASK,
                    np.where(v < settings.replace_mask + settings.replace_random, RANDOM, KEEP))
    inputs = tokens.copy()
    inputs[chosen[acts == MASK]] = vocab.mask_id
    inputs[chosen[acts == RANDOM]] = vocab.normal[r[acts == RANDOM]]
    action = np.zeros(tokens.shape[0], dtype=np.int8)
    action[chosen] = acts
    return inputs, action


@dataclass(frozen=True)
class MaskRecord:
    """A batch's corruption, column by column (host tensors ``[B, T]``): ``original``
    the uncorrupted token (``pad_id`` on padding), ``action`` one of ``NONE``,
    ``MASK``, ``RANDOM``, ``KEEP``."""

    original: torch.Tensor  # [B, T] int64
    action: torch.Tensor  # [B, T] int8


class MLMCompiler:
    """The masked-LM ``RowCompiler``: each piece corrupted from its own generator,
    labels the original tokens at the selected columns, batches not causal; the
    corruption record is ``batch.meta["mlm"]`` (``MaskRecord``). The rule:
    docs/design/families.md#familiesmlmcompilerpy."""

    name = "mlm"

    def __init__(self, settings: MLMConfig, vocab: Vocabulary, *, seed: int) -> None:
        self.settings = settings
        self.vocab = vocab
        self.seed = seed

    def capacity(self, cfg: BatchConfig) -> int:
        return cfg.seq_len

    def corrupt(
        self, tokens: np.ndarray, example_id: int, piece: Piece
    ) -> tuple[np.ndarray, np.ndarray]:
        """One piece's ``(inputs, action)``, drawn from its own address."""
        rng = piece_generator(self.seed, piece.epoch, example_id, piece.piece)
        return corrupt_piece(tokens, rng, self.settings, self.vocab)

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        """Segments laid out as in ``rows.causal`` (positions per ``cfg.positions``,
        ids 1, 2, ... and 0 on padding, weights per example), each piece corrupted
        by ``corrupt``; labels the original tokens at selected columns; not causal."""
        n_rows, seq_len = len(rows), cfg.seq_len
        input_ids = np.full((n_rows, seq_len), pad_id, dtype=np.int64)  # [B, T]
        original = np.full((n_rows, seq_len), pad_id, dtype=np.int64)  # [B, T]
        action = np.zeros((n_rows, seq_len), dtype=np.int8)  # [B, T]
        position_ids = np.zeros((n_rows, seq_len), dtype=np.int64)  # [B, T]
        segment_ids = np.zeros((n_rows, seq_len), dtype=np.int32)  # [B, T]
        weights = np.zeros((n_rows, seq_len), dtype=np.float32) if weighted else None
        columns = np.arange(seq_len, dtype=np.int64)
        all_segments = []
        for r, row in enumerate(rows):
            segments, start = [], 0
            for s, piece in enumerate(row, start=1):
                example = examples[piece.example]
                a, length, stop = piece.offset, piece.length, start + piece.length
                tokens = np.asarray(example.tokens[a : a + length], dtype=np.int64)
                inputs, acts = self.corrupt(tokens, example.example_id, piece)
                input_ids[r, start:stop] = inputs
                original[r, start:stop] = tokens
                action[r, start:stop] = acts
                position_ids[r, start:stop] = (
                    columns[:length] if cfg.positions == "reset" else columns[start:stop]
                )
                segment_ids[r, start:stop] = s
                if weights is not None:
                    weights[r, start:stop] = example_weight(example)
                segments.append(Segment(example.example_id, piece.piece, a, start, length))
                start = stop
            all_segments.append(tuple(segments))
        labels = np.where(action != NONE, original, IGNORE_INDEX)  # [B, T]
        record = MaskRecord(torch.from_numpy(original), torch.from_numpy(action))
        return Batch(
            input_ids=torch.from_numpy(input_ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(position_ids),
            segment_ids=torch.from_numpy(segment_ids),
            segments=tuple(all_segments),
            causal=False,
            weights=None if weights is None else torch.from_numpy(weights),
            meta={"mlm": record},
        )

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """The R7 checks of a masked-LM batch; ``BatchInvariantError`` naming the example.

        The generic ones (``rows.invariants``: shapes, ids in the vocabulary, no label
        on padding) without the last-column-of-a-segment check, which is about a
        shifted target leaving its segment: here a target is its own column's token.
        Then, against the batch's corruption record: the batch is not causal; every
        supervised label is the original token at its column and sits on a selected
        position, and every selected position is supervised; a label is never a
        special id; an unselected column shows its original token, a masked one the
        mask id, a kept one its original, a random one a non-special id; and each
        segment selects exactly ``selection_count`` of its eligible tokens.
        """
        check_batch(batch, vocab_size, boundary="keep")  # "keep": no boundary check
        record = batch.meta.get("mlm")
        if not isinstance(record, MaskRecord) or record.action.shape != batch.labels.shape:
            raise BatchInvariantError("a masked-LM batch carries no corruption record "
                                      "(batch.meta['mlm']); compile it with the mlm compiler")
        if batch.causal:
            raise BatchInvariantError("a masked-LM batch must not be causal (its encoder "
                                      "sees the whole segment)")
        labels, inputs = batch.labels, batch.input_ids
        original, action = record.original, record.action.long()
        real = batch.segment_ids > 0
        selected = (action != NONE) & real
        supervised = labels != IGNORE_INDEX
        special = torch.from_numpy(np.isin(original.numpy(), self.vocab.special))
        fail_at(batch, supervised & ~selected,
                "label {value} sits on a position that was not selected", labels)
        fail_at(batch, selected & ~supervised, "a selected position has no label", labels)
        fail_at(batch, supervised & (labels != original),
                "label {value} is not the original token of its column", labels)
        fail_at(batch, selected & special, "special token {value} was selected", original)
        fail_at(batch, real & ~selected & (inputs != original),
                "unselected column shows {value}, not its original token", inputs)
        fail_at(batch, (action == MASK) & (inputs != self.vocab.mask_id),
                "masked column shows {value}, not the mask id", inputs)
        fail_at(batch, (action == KEEP) & (inputs != original),
                "kept column shows {value}, not its original token", inputs)
        random_special = torch.from_numpy(np.isin(inputs.numpy(), self.vocab.special))
        fail_at(batch, (action == RANDOM) & random_special,
                "random replacement {value} is a special id", inputs)
        self.check_counts(batch, selected, special)

    def check_counts(self, batch: Batch, selected: torch.Tensor, special: torch.Tensor) -> None:
        """Each segment selects ``selection_count(eligible, mask_rate)`` positions."""
        for b, row in enumerate(batch.segments):
            for seg in row:
                cols = slice(seg.start, seg.stop)
                eligible = seg.length - int(special[b, cols].sum())
                got = int(selected[b, cols].sum())
                want = selection_count(eligible, self.settings.mask_rate)
                if got != want:
                    raise BatchInvariantError(
                        f"row {b} columns {seg.start}..{seg.stop - 1} (example {seg.example_id}, "
                        f"piece {seg.piece}): {got} positions selected of {eligible} eligible; "
                        f"the rule selects {want}")

    def render(self, batch: Batch, tokenizer: TokenizerLike, rows: range) -> str:
        """``exactstep inspect`` for masked-LM rows: per column the original token, the
        corrupted input the model sees, the target, the action and the visible span."""
        n_rows = batch.shape[0]
        chosen = [b for b in rows if 0 <= b < n_rows]
        if not chosen:
            return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{n_rows}"
        return "\n\n".join(render_masked_row(batch, tokenizer, b) for b in chosen)


def render_masked_row(batch: Batch, tokenizer: TokenizerLike, b: int) -> str:
    record: MaskRecord = batch.meta["mlm"]
    original, inputs = record.original[b].tolist(), batch.input_ids[b].tolist()
    labels, actions = batch.labels[b].tolist(), record.action[b].tolist()
    segments = batch.segments[b]
    real = sum(seg.length for seg in segments)
    counts = {name: actions.count(code) for code, name in ACTION_NAMES.items() if code != NONE}
    lines = [f"row {b}: {len(segments)} segment(s), {real} tokens, {len(inputs) - real} "
             f"padding, {sum(counts.values())} selected ({counts['mask']} mask, "
             f"{counts['random']} random, {counts['keep']} keep), bidirectional"]
    for s, seg in enumerate(segments, start=1):
        lines.append(f"  segment {s}: example {seg.example_id} piece {seg.piece} tokens "
                     f"{seg.offset}..{seg.offset + seg.length - 1} at cols {seg.start}.."
                     f"{seg.stop - 1}")
    shown = {name: [token_label(tokenizer, t) for t in values]
             for name, values in (("original", original), ("input", inputs))}
    targets = [NO_TARGET if t == IGNORE_INDEX else token_label(tokenizer, t) for t in labels]
    w = max(8, *map(len, shown["original"]), *map(len, shown["input"]), *map(len, targets))
    lines.append(f"  {'col':>4} {'seg':>3} {'pos':>4}  {'original':<{w}}   {'input':<{w}}   "
                 f"{'target':<{w}} {'action':<6}  visible")
    owner = {col: (k, seg) for k, seg in enumerate(segments) for col in range(seg.start, seg.stop)}
    positions, segment_ids = batch.position_ids[b].tolist(), batch.segment_ids[b].tolist()
    for col in range(len(inputs)):
        if col in owner:
            first, last = visible_span(batch, b, *owner[col], col)
            visible = f"cols {first}..{last}"
        else:
            visible = "none (padding)"
        lines.append(f"  {col:>4} {segment_ids[col]:>3} {positions[col]:>4}  "
                     f"{shown['original'][col]:<{w}} → {shown['input'][col]:<{w}} ⇒ "
                     f"{targets[col]:<{w}} {ACTION_NAMES[actions[col]]:<6}  {visible}")
    return "\n".join(lines)
