"""The prefix LM family (R8): a bidirectional prompt, a causal continuation.

An example's prompt is every token before its first supervised target; the compiler
emits the causal family's rows (the shift once, R1) plus ``Batch.prefix_len``, the
prompt columns of each segment, which attention sees bidirectionally. No supervised
row's target lies inside its prefix (R7), so no row sees what it predicts.
Design and derivations: docs/design/families.md#familiesprefixcompilerpy (R8, R1, R2, R5, R7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from exactstep.errors import BatchInvariantError
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, where
from exactstep.rows.packing import Piece


def prompt_length(example: Example) -> int:
    """Tokens of ``example`` before its first supervised target: its prefix ``P``.

    Text examples (``owned is None``: every token but the first is a target) have
    ``P = 1`` (the BOS). An example without any target is all prompt (``P = n``).
    """
    if example.owned is None:
        return min(1, len(example))
    targets = np.flatnonzero(example.owned)
    return int(targets[0]) if targets.size else len(example)


def piece_prefix(example: Example, offset: int, length: int) -> int:
    """Columns of the piece ``[offset, offset + length)`` that lie in the prompt."""
    return max(0, min(prompt_length(example) - offset, length))


def compile_prefix_batch(
    rows: Sequence[Sequence[Piece]],
    examples: Sequence[Example],
    *,
    seq_len: int,
    pad_id: int,
    boundary: str = "ignore",
    positions: str = "reset",
    weighted: bool = False,
) -> Batch:
    """The causal rows of ``rows`` (``rows.causal``) plus ``prefix_len [B, n_seg]``
    int64, ``n_seg`` the most pieces of any row (at least 1), 0 past a row's pieces."""
    batch = compile_causal_batch(rows, examples, seq_len=seq_len, pad_id=pad_id,
                                 boundary=boundary, positions=positions, weighted=weighted)
    prefix = np.zeros((len(rows), max([len(row) for row in rows] + [1])), dtype=np.int64)
    for r, row in enumerate(rows):
        for k, piece in enumerate(row):
            prefix[r, k] = piece_prefix(examples[piece.example], piece.offset, piece.length)
    return replace(batch, prefix_len=torch.from_numpy(prefix))


def check_prefix_batch(batch: Batch) -> None:
    """R7 for prefix batches: ``prefix_len`` is ``[B, n_seg]`` with ``n_seg`` covering
    every row's segments and each value in ``[0, length]``, and no supervised row's
    target lies inside its segment's prefix (the row would see the token it
    predicts). Raises ``BatchInvariantError`` naming the example."""
    prefix = batch.prefix_len
    B = batch.shape[0]
    most = max([len(row) for row in batch.segments] + [1])
    if prefix is None or prefix.dim() != 2 or prefix.shape[0] != B or prefix.shape[1] < most:
        shape = None if prefix is None else tuple(prefix.shape)
        raise BatchInvariantError(
            f"prefix_len has shape {shape}; a prefix batch needs [{B}, >= {most}]")
    values = prefix.tolist()
    supervised = (batch.labels != IGNORE_INDEX).tolist()
    for b, row in enumerate(batch.segments):
        for k, seg in enumerate(row):
            p = values[b][k]
            if not 0 <= p <= seg.length:
                raise BatchInvariantError(
                    f"{where(batch, b, seg.start)}: prefix_len {p} is outside [0, {seg.length}]"
                    " (the segment's length)")
            for col in range(seg.start, seg.start + p - 1):  # rows whose target is in it
                if supervised[b][col]:
                    raise BatchInvariantError(
                        f"{where(batch, b, col)}: a supervised row inside the segment's "
                        f"bidirectional prefix ({p} columns): it would see the target it "
                        "predicts; targets belong to the continuation")


class PrefixCompiler:
    """The prefix LM compiler: causal rows, prompt prefixes (``prefix_len``), and the
    R7 checks plus ``check_prefix_batch``. Why the prefix ends where it does:
    docs/design/families.md#familiesprefixcompilerpy."""

    name = "prefix"

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
        return compile_prefix_batch(rows, examples, seq_len=cfg.seq_len, pad_id=pad_id,
                                    boundary=cfg.boundary, positions=cfg.positions,
                                    weighted=weighted)

    def check(self, batch: Batch, vocab_size: int | None, cfg: BatchConfig) -> None:
        check_batch(batch, vocab_size, cfg.boundary, next_token_targets=True)
        check_prefix_batch(batch)


PREFIX = PrefixCompiler()
