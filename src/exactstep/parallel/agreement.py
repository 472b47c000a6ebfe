"""The window under many processes: one engine, one reducer, equal microbatch counts (D1, D2).

``distribute_engine`` makes a single-process ``UpdateEngine`` one rank of the job
(the ``DDPReducer``, DDP with ``no_sync``); ``agreed_window`` gives every rank the same
microbatch count, padding with empty microbatches that leave the update unchanged
(D1, U1); ``agreed_stop`` makes a stop signal one decision of all ranks.
Design and derivations: docs/design/parallel.md#parallelagreementpy (D1, D2, U1).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from itertools import islice

import torch

from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import DistContext
from exactstep.parallel.reducer import DDPReducer
from exactstep.parallel.wrap import wrap_train_module
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment

PAD_EXAMPLE_ID = -1  # row address of a padding microbatch's rows (R6)


def distribute_engine(engine, ctx: DistContext, cfg: ParallelConfig):
    """Make ``engine`` one rank of the job (no-op for a single process); returns it.

    Must run before the first window. The engine's parameters are the model's own
    (DDP shares them), so clipping and checkpoints are unaffected; under ``zero1`` the
    optimizer becomes a ``ShardedOptimizer`` over the same groups (its state empty
    until the first step).
    """
    if not ctx.distributed:
        if cfg.strategy == "zero1":
            print("exactstep: parallel.strategy = zero1 in one process: the optimizer state "
                  "is not sharded (all of it here); launch several processes (--nproc, "
                  "torchrun) to shard", file=sys.stderr)
        return engine
    engine.reducer = DDPReducer(ctx)
    engine.train_module = wrap_train_module(engine.train_module, ctx, cfg)
    if cfg.strategy == "zero1":
        from exactstep.parallel.zero import shard_optimizer  # lazy: torch.distributed.optim, 0.7 s

        engine.optimizer = shard_optimizer(engine.optimizer, ctx, cfg)
    return engine


def empty_microbatch(rows: int, seq_len: int, pad_id: int) -> Batch:
    """A microbatch with nothing supervised, safe to run forward and backward.

    Every row is one segment of padding *tokens* marked as a real segment (id 1), so
    attention has at least one visible key per query (a fully masked row would give
    NaN, and NaN * 0 is still NaN in the backward). All labels are ``IGNORE_INDEX``.
    """
    input_ids = torch.full((rows, seq_len), pad_id, dtype=torch.int64)  # [B, T]
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)  # [B, T]
    positions = torch.arange(seq_len, dtype=torch.int64).expand(rows, seq_len).clone()
    segment_ids = torch.ones((rows, seq_len), dtype=torch.int32)  # [B, T]
    segment = (Segment(PAD_EXAMPLE_ID, 0, 0, 0, seq_len),)
    return Batch(input_ids, labels, positions, segment_ids, tuple(segment for _ in range(rows)),
                 meta={"padding": True})


def agreed_window(
    it: Iterator[Batch],
    k: int,
    reducer: DDPReducer | None,
    *,
    rows: int,
    seq_len: int,
    pad_id: int,
) -> list[Batch]:
    """Up to ``k`` microbatches from ``it``, padded so every rank has the same count.

    Without a reducer (one process) this is simply the next ``k`` batches. With one,
    the count is agreed by an all-reduce (max); an empty list means every rank's
    stream has ended. Costs one small collective per window.
    """
    batches = list(islice(it, k))
    if reducer is None:
        return batches
    count = int(reducer.max(torch.tensor([len(batches)], dtype=torch.int64)).item())
    while len(batches) < count:
        batches.append(empty_microbatch(rows, seq_len, pad_id))
    return batches


def agreed_windows(it: Iterator[Batch], k: int, reducer: DDPReducer | None, *, rows: int,
                   seq_len: int, pad_id: int) -> Iterator[list[Batch]]:
    """``agreed_window`` after ``agreed_window`` until every rank's stream has ended:
    up to ``k`` microbatches each, fewer only at the end of the data (U1 remainder),
    the same count on every rank (D1)."""
    while batches := agreed_window(it, k, reducer, rows=rows, seq_len=seq_len, pad_id=pad_id):
        yield batches


def agreed_stop(requested: bool, reducer: DDPReducer | None) -> bool:
    """True when any rank was asked to stop (SIGTERM / SIGINT), decided by all ranks.

    A signal reaches ranks at different moments; stopping on the local flag would let
    one rank publish a checkpoint at window ``w`` while another runs window ``w + 1``,
    and their checkpoint collectives would not line up. One tiny host all-reduce
    (max) per window; without a reducer the local flag is the decision.
    """
    if reducer is None:
        return requested
    return bool(reducer.max(torch.tensor([int(requested)], dtype=torch.int64)).item())
