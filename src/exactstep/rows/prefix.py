"""The prefix LM family (R8): a bidirectional prompt, a causal continuation.

Each example is split, by its own declared target program, into a *prompt* (the
prefix) and a *continuation*: the prompt is every token before the example's first
supervised target (``prompt_length``), the continuation is the rest. For chat data
(the built-in arithmetic conversations or a chat JSONL, rendered and owned exactly as
the chat family does, R5) the prompt is everything up to and including the header
of the first supervised assistant turn, and the targets are the supervised assistant
tokens after it; for text examples (every token but the first owned) the prompt is
the BOS alone, i.e. plain causal LM.

The boundary is read from the example's declared target program (its first target),
fixed before packing; ownership still never hides a key (R2): the prefix only adds
visibility inside the prompt, and every prompt row stays visible to later rows.

Visibility (``model.attention``): query ``i`` sees key ``j`` of the same segment iff
``j <= i`` or ``j`` lies in the segment's prefix. The compiler describes it
structurally, never as a mask: the causal family's rows (the same inputs, labels,
positions and segments, the shift done once, R1) plus ``Batch.prefix_len[b, k]``,
the columns of segment ``k`` of row ``b`` that belong to its example's prompt.

Where the prefix ends, and why there. Tokens ``t_0 .. t_(n-1)``, first target
``t_f`` (``f >= 1``: token 0 is never a target). Row ``i`` holds ``t_i`` and, after
the shift, is scored against ``t_(i+1)`` when that token is a target, so the first
supervised row is ``f - 1``: the last prompt row (the last byte of the assistant
header). The prefix is ``P = f`` tokens, the whole prompt including that row:

- row ``f - 1`` sees the whole prompt and nothing after it, so it never sees
  ``t_f``, the token it predicts; every later row ``i`` sees ``j <= i`` (the prefix
  lies before it), so it never sees ``t_(i+1)`` either. Through any number of
  layers a row ``i`` depends on exactly the tokens ``j <= max(i, P - 1)``, which for
  every supervised row (``i >= P - 1``) is ``j <= i``;
- ``P = f + 1`` is the first leaky prefix: row ``f - 1`` would see its own target.
  A shorter prefix would also be safe but would cut the prompt into a bidirectional
  and a causal part for no reason: a prefix LM's prompt is one bidirectional block.

With a single attention layer the prefix changes no supervised row: row ``f - 1``
sees the whole prompt causally anyway, and a layer's keys carry only their own
token. From two layers on, prompt rows mix later prompt tokens into what the
supervised rows read; that is all a prefix LM adds over the causal chat family.

So the invariant the compiler's ``check`` enforces (R7 for this family) is: every
supervised row's target lies at or after its segment's prefix end (``i + 1 >=
start + prefix_len``), and ``0 <= prefix_len <= length``. A piece of a split example
(offset ``a``) keeps the part ``[a, P)`` of the prompt that it holds.

The family around this compiler (data, model, score) is ``families.prefix``.
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
    """The prefix LM compiler (see module doc): causal rows, prompt prefixes."""

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
