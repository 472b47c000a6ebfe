"""The permutation-LM compiler (XLNet-style, R8): factorisation orders over natural positions.

Tokens stay in place: a row's inputs, positions and segments are the causal
compiler's, and ``Batch.order`` carries each column's rank in its segment's sampled
factorisation order (drawn per piece, S5); the last ``min(ceil(F / K), L - 1)``
columns of the order are predicted, each labelled with its own token (no shift).
Design and derivations: docs/design/families.md#familiespermutationcompilerpy (R8, L3, R7, S5).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.ranges import at_least, check
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.causal import example_weight
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.inspect import token_label
from exactstep.rows.invariants import check_batch, fail_at, where
from exactstep.rows.packing import Piece

#: The second word of every order draw's address: ``b"perm"`` as an integer, so these
#: draws never coincide with another family's draws at the same (seed, epoch, example).
ORDER_TAG = 0x7065726D


def draw_order(n: int, *, seed: int, epoch: int, example_id: int, piece: int) -> np.ndarray:
    """The random order of a segment's ``n`` free tokens: ``int64 [n]``, a permutation of
    ``0 .. n-1`` from a generator addressed by ``(seed, ORDER_TAG, epoch, example_id,
    piece)`` alone, so packing, sharding, evaluation and resume never change it."""
    rng = np.random.default_rng([seed, ORDER_TAG, epoch, example_id, piece])
    return rng.permutation(n).astype(np.int64)


def predicted_count(free: int, length: int, predict_one_in: int) -> int:
    """``min(ceil(free / K), length - 1)``, in integers (never below 0)."""
    return max(0, min(-(-free // predict_one_in), length - 1))


def segment_order(
    example: Example, piece: Piece, *, seed: int, predict_one_in: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(rank [L], predicted [L] bool)`` of one segment, indexed by its columns."""
    a, length = piece.offset, piece.length
    if example.owned is None:
        free = np.arange(a, a + length) >= 1  # every token but the example's first
    else:
        free = np.asarray(example.owned[a : a + length], dtype=bool)
    context_cols = np.flatnonzero(~free)
    free_cols = np.flatnonzero(free)
    shuffled = free_cols[draw_order(len(free_cols), seed=seed, epoch=piece.epoch,
                                    example_id=example.example_id, piece=piece.piece)]
    z = np.concatenate([context_cols, shuffled])  # [L] columns in factorisation order
    rank = np.empty(length, dtype=np.int64)
    rank[z] = np.arange(length, dtype=np.int64)
    n = predicted_count(len(free_cols), length, predict_one_in)
    predicted = rank >= length - n
    return rank, predicted


class PermutationCompiler:
    """Rows of pieces -> a permutation-LM ``Batch``: the causal compiler's inputs,
    positions and segments, ``order`` the rank of each column in its segment's
    factorisation order (context first, then the free tokens drawn), the last
    ``min(ceil(F / predict_one_in), L - 1)`` of the order labelled with their own
    token. ``batch.boundary = "keep"`` is refused (``ConfigError``). Design:
    docs/design/families.md#familiespermutationcompilerpy."""

    name = "permutation"

    def __init__(self, *, seed: int, predict_one_in: int = 6) -> None:
        check("permutation.predict_one_in", predict_one_in, at_least(1))
        self.seed = seed
        self.predict_one_in = predict_one_in

    def capacity(self, cfg: BatchConfig) -> int:
        return cfg.seq_len

    def compile(
        self,
        rows: Sequence[Sequence[Piece]],
        examples: Sequence[Example],
        cfg: BatchConfig,
        *,
        pad_id: int,
        weighted: bool,
    ) -> Batch:
        require_ignore_boundary(cfg)
        n_rows, seq_len = len(rows), cfg.seq_len
        input_ids = np.full((n_rows, seq_len), pad_id, dtype=np.int64)  # [B, T]
        labels = np.full((n_rows, seq_len), IGNORE_INDEX, dtype=np.int64)  # [B, T]
        position_ids = np.zeros((n_rows, seq_len), dtype=np.int64)  # [B, T]
        segment_ids = np.zeros((n_rows, seq_len), dtype=np.int32)  # [B, T]
        order = np.zeros((n_rows, seq_len), dtype=np.int64)  # [B, T]
        weights = np.zeros((n_rows, seq_len), dtype=np.float32) if weighted else None
        columns = np.arange(seq_len, dtype=np.int64)  # [T]
        all_segments = []
        for r, row in enumerate(rows):
            segments, start = [], 0
            for s, piece in enumerate(row, start=1):
                example = examples[piece.example]
                a, length, stop = piece.offset, piece.length, start + piece.length
                tokens = example.tokens[a : a + length]
                rank, predicted = segment_order(example, piece, seed=self.seed,
                                                predict_one_in=self.predict_one_in)
                input_ids[r, start:stop] = tokens
                labels[r, start:stop] = np.where(predicted, tokens, IGNORE_INDEX)
                order[r, start:stop] = rank
                position_ids[r, start:stop] = (
                    columns[:length] if cfg.positions == "reset" else columns[start:stop])
                segment_ids[r, start:stop] = s
                if weights is not None:
                    weights[r, start:stop] = example_weight(example)
                segments.append(Segment(example.example_id, piece.piece, a, start, length))
                start = stop
            all_segments.append(tuple(segments))
        return Batch(
            input_ids=torch.from_numpy(input_ids),
            labels=torch.from_numpy(labels),
            position_ids=torch.from_numpy(position_ids),
            segment_ids=torch.from_numpy(segment_ids),
            segments=tuple(all_segments),
            weights=None if weights is None else torch.from_numpy(weights),
            order=torch.from_numpy(order),
        )

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        """R7 plus the permutation checks (``check_order``); ``BatchInvariantError``
        naming the row address."""
        check_batch(batch, vocab_size, "keep")  # no target crosses a segment here
        check_order(batch)

    def render(self, batch: Batch, tokenizer: Any, rows: range) -> str:
        """``exactstep inspect``: each column's rank in its segment's order, its target,
        and the ranks each stream sees."""
        chosen = [b for b in rows if 0 <= b < batch.shape[0]]
        if not chosen:
            return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{batch.shape[0]}"
        return "\n\n".join(render_row(batch, b, lambda t: token_label(tokenizer, t))
                           for b in chosen)


def require_ignore_boundary(cfg: BatchConfig) -> None:
    if cfg.boundary != "ignore":
        raise ConfigError(
            "objective.family = 'permutation' predicts tokens inside their own segment; "
            "batch.boundary = 'keep' has no meaning there: set batch.boundary = 'ignore'"
        )


def check_order(batch: Batch) -> None:
    """The permutation checks of ``PermutationCompiler.check``: every segment's
    ``order`` is a permutation of its ranks, every supervised label is the token at
    its own column, rank 0 is never supervised, and the supervised columns are
    exactly the last ones of the order."""
    order = batch.order
    if order is None or tuple(order.shape) != batch.shape:
        shape = None if order is None else tuple(order.shape)
        raise BatchInvariantError(
            f"a permutation-LM batch needs order of shape {batch.shape}; got {shape}")
    supervised = batch.labels != IGNORE_INDEX  # [B, T]
    fail_at(batch, supervised & (batch.labels != batch.input_ids),
            "label {value} is not the token at its own column (a permutation-LM target is "
            "the token at the predicted position)", batch.labels)
    fail_at(batch, supervised & (order == 0),
            "the first token of the factorisation order is supervised (label {value}): it "
            "would be predicted with no context", batch.labels)
    ranks_of, owned_of = order.numpy(), supervised.numpy()  # host tensors: no copy
    for b, segments in enumerate(batch.segments):
        for seg in segments:
            ranks = ranks_of[b, seg.start : seg.stop]
            owned = owned_of[b, seg.start : seg.stop]
            if not np.array_equal(np.sort(ranks), np.arange(seg.length)):
                raise BatchInvariantError(
                    f"{where(batch, b, seg.start)}: the segment's order {ranks.tolist()} is "
                    f"not a permutation of 0..{seg.length - 1}")
            n = int(owned.sum())
            if n and not np.array_equal(owned, ranks >= seg.length - n):
                raise BatchInvariantError(
                    f"{where(batch, b, seg.start)}: the supervised columns are not the last "
                    f"{n} of the factorisation order (the partial-prediction cutoff)")


def render_row(batch: Batch, b: int, show) -> str:
    """One row of ``render``: per column its segment, position, rank, input, target."""
    inputs, labels = batch.input_ids[b].tolist(), batch.labels[b].tolist()
    ranks, positions = batch.order[b].tolist(), batch.position_ids[b].tolist()
    segment_ids = batch.segment_ids[b].tolist()
    segments = batch.segments[b]
    lines = [f"row {b}: {len(segments)} segment(s), "
             f"{sum(label != IGNORE_INDEX for label in labels)} predicted tokens "
             "(target = the token at its own column; tokens stay in natural order)"]
    for s, seg in enumerate(segments, start=1):
        z = sorted(range(seg.start, seg.stop), key=lambda col: ranks[col])
        lines.append(f"  segment {s}: example {seg.example_id} piece {seg.piece} tokens "
                     f"{seg.offset}..{seg.offset + seg.length - 1} at cols "
                     f"{seg.start}..{seg.stop - 1}; order (columns) {' '.join(map(str, z))}")
    shown = [show(t) for t in inputs]
    targets = ["·" if label == IGNORE_INDEX else show(label) for label in labels]
    w = max(8, *map(len, shown), *map(len, targets))
    lines.append(f"  {'col':>4} {'seg':>3} {'pos':>4} {'rank':>4}  {'input':<{w}}   "
                 f"{'target':<{w}} content sees / query sees (same segment)")
    for col in range(len(labels)):
        if segment_ids[col] == 0:
            seen = "itself / nothing (padding)"
        elif ranks[col] == 0:
            seen = "rank 0 / nothing"
        else:
            seen = f"ranks <= {ranks[col]} / ranks < {ranks[col]}"
        lines.append(f"  {col:>4} {segment_ids[col]:>3} {positions[col]:>4} {ranks[col]:>4}  "
                     f"{shown[col]:<{w}} → {targets[col]:<{w}} {seen}")
    return "\n".join(lines)
