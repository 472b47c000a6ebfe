"""Spawned ranks for the ZeRO-1 / ZeRO-2 proofs (tests/parallel/test_zero.py; D1, D4, U3, U4, S5, S7).

One job of two gloo ranks runs every scenario in turn, each with a fresh engine: the
layouts (ddp, zero1, zero2) and their planted wrong variants over the same windows,
then a checkpoint round trip per strategy and the cross-strategy refusals. Each rank
writes what the test checks: parameters gathered whole after windows 1 and 3, the
ledger, and the shape of the optimizer state it holds (per parameter and state key,
the elements of its local tensors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from workers import (
    UPDATE,
    LocalShardNormEngine,
    build_rank_engine,
    common_state,
    full_params,
    load_common,
    run_rank,
    stream_for,
)

from exactstep.errors import DistributedError
from exactstep.parallel.config import ParallelConfig
from exactstep.update.window import UpdateEngine

WORLD = 2
AFTER = (0, 2)  # the windows after which parameters are recorded: 1 window and 3


class ShardNormEngine(UpdateEngine):
    """Deliberately wrong (negative control for U3 under ZeRO-1): each rank clips by
    the norm of the gradients of the parameters it steps (its optimizer shard) only."""

    def _grad_norm(self) -> torch.Tensor:
        from torch.nn.utils import get_total_norm

        mine = {id(p) for p in self.optimizer.shard_params()}
        return get_total_norm([p.grad for p in self.parameters
                               if id(p) in mine and p.grad is not None], 2.0).float()


def ungathered(engine: UpdateEngine) -> UpdateEngine:
    """Deliberately wrong (negative control for ZeRO-1): each rank steps its shard but
    the updated shards are never broadcast, so a rank keeps stale copies of the rest."""
    engine.optimizer.step = engine.optimizer._local_step
    return engine


def unsynced_lr(engine: UpdateEngine) -> UpdateEngine:
    """Deliberately wrong (negative control for the engine's lr under ZeRO-1): the
    exposed groups' attributes never reach the shard's optimizer, so each shard steps
    with the lr it was built with while the schedule warms up."""
    engine.optimizer._sync_param_groups = lambda src, dst: None
    return engine


WARMUP = replace(UPDATE, warmup=3, schedule="cosine")  # the lr changes every window

LAYOUTS = {  # name -> (strategy, engine class, planted change, update settings)
    "ddp": ("ddp", UpdateEngine, None, UPDATE),
    "zero1": ("zero1", UpdateEngine, None, UPDATE),
    "zero2": ("zero2", UpdateEngine, None, UPDATE),
    "fsdp": ("fsdp", UpdateEngine, None, UPDATE),
    "zero1_shard_norm": ("zero1", ShardNormEngine, None, UPDATE),
    "zero1_ungathered": ("zero1", UpdateEngine, ungathered, UPDATE),
    "zero2_local_norm": ("zero2", LocalShardNormEngine, None, UPDATE),
    "ddp_warmup": ("ddp", UpdateEngine, None, WARMUP),
    "zero1_warmup": ("zero1", UpdateEngine, None, WARMUP),
    "zero1_unsynced_lr": ("zero1", UpdateEngine, unsynced_lr, WARMUP),
}


def state_layout(engine: UpdateEngine) -> dict[str, dict[str, list[int]]]:
    """For each parameter (by name) whose optimizer state this rank holds: per state
    key, the shape of the local tensor (an FSDP2 DTensor's local shard)."""
    local = getattr(engine.optimizer, "optim", engine.optimizer)
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out: dict[str, dict[str, list[int]]] = {}
    for param, state in local.state.items():
        out[names[id(param)]] = {
            key: list((v.to_local() if hasattr(v, "to_local") else v).shape)
            for key, v in state.items() if isinstance(v, torch.Tensor)}
    return out


def local_state(engine: UpdateEngine) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state tensors by parameter name (local shards), copied."""
    local = getattr(engine.optimizer, "optim", engine.optimizer)
    names = {id(p): n for n, p in engine.model.named_parameters()}
    return {names[id(p)]: {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                           for k, v in s.items() if isinstance(v, torch.Tensor)}
            for p, s in local.state.items()}


@contextlib.contextmanager
def counted_all_gathers() -> Iterator[list[int]]:
    """Inside, every all-gather FSDP2 issues for a parameter group (one unshard of one
    ``fully_shard`` unit) is recorded."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups

    original, calls = groups.foreach_all_gather, []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    groups.foreach_all_gather = counting
    try:
        yield calls
    finally:
        groups.foreach_all_gather = original


def engine_for(ctx, strategy: str, cls=UpdateEngine, update=UPDATE) -> UpdateEngine:
    return build_rank_engine(ctx, ParallelConfig(strategy=strategy, timeout_s=30.0),
                             update, cls)


def run_layout(ctx, rank: int, name: str, windows) -> dict:
    from exactstep.parallel.zero import optimizer_state_bytes

    strategy, cls, planted, update = LAYOUTS[name]
    engine = engine_for(ctx, strategy, cls, update)
    if planted is not None:
        planted(engine)
    held: list[list[int]] = []  # a block's weight as it stands once the block's forward ended
    engine.model.layers[0].register_forward_hook(
        lambda module, args, output: held.append(list(module.attn.qkv.weight.shape) if not
                                                 hasattr(module.attn.qkv.weight, "to_local")
                                                 else list(module.attn.qkv.weight.to_local()
                                                           .shape)))
    ledger, params, gathers = [], {}, []
    for w, batches in enumerate(windows[rank]):
        with counted_all_gathers() as calls:
            ledger.append(engine.run_window(list(batches), w).ledger_record())
        gathers.append(len(calls))
        if w in AFTER:
            params[w + 1] = full_params(engine)
    return {"params": params, "ledger": ledger, "state": state_layout(engine),
            "state_bytes": optimizer_state_bytes(engine.optimizer),
            "optimizer": type(engine.optimizer).__name__, "after_forward": held,
            "all_gathers": gathers,
            "groups": [{k: v for k, v in g.items() if k != "params"}
                       for g in engine.optimizer.param_groups]}


def train(engine: UpdateEngine, windows, first: int, count: int) -> list[dict]:
    return [engine.run_window(list(windows[w]), w).ledger_record()
            for w in range(first, first + count)]


def perturb(engine: UpdateEngine) -> None:
    """Move every parameter away from the seed's (a load must bring them back)."""
    with torch.no_grad():
        for p in engine.parameters:
            p.add_(0.5)


def round_trip(ctx, rank: int, strategy: str, windows, root: Path) -> dict:
    """2 windows, checkpoint, 2 windows (straight); a fresh, perturbed engine loads the
    checkpoint and runs the same 2 windows (resumed); the control loads the weights
    and the common parts but not the optimizer state."""
    import torch.distributed.checkpoint as dcp

    from exactstep.parallel.dcp_format import (
        load_distributed_checkpoint,
        save_distributed_checkpoint,
    )

    mine = windows[rank]
    engine = engine_for(ctx, strategy)
    first = train(engine, mine, 0, 2)
    saved_state = local_state(engine)
    path = save_distributed_checkpoint(root / strategy, "window-00000002", model=engine.model,
                                       optimizer=engine.optimizer, common=common_state(engine),
                                       rank_state={"data": stream_for(rank, WORLD).state_dict()}, ctx=ctx, keep=2, strategy=strategy)
    straight = train(engine, mine, 2, 2)
    out = {"path": str(path), "saved_state": saved_state,
           "straight": {"params": full_params(engine), "ledger": first + straight,
                        "state": local_state(engine)}}

    engine = engine_for(ctx, strategy)
    perturb(engine)
    state = load_distributed_checkpoint(path, model=engine.model, optimizer=engine.optimizer,
                                        ctx=ctx, strategy=strategy)
    load_common(engine, state.common)
    resumed = train(engine, mine, 2, 2)
    out["resumed"] = {"params": full_params(engine), "ledger": first + resumed,
                      "state": local_state(engine)}

    control = engine_for(ctx, strategy)
    perturb(control)
    model_sd = dict(control.model.state_dict())
    dcp.load({"model": model_sd}, checkpoint_id=str(path / "dcp"))
    control.model.load_state_dict(model_sd)
    load_common(control, state.common)
    train(control, mine, 2, 2)
    out["control"] = {"params": full_params(control)}
    return out


def refused(ctx, path: str, saved: str, strategy: str) -> dict:
    """Load the ``saved``-strategy checkpoint at ``path`` into a ``strategy`` engine:
    the error, and whether the parameters moved."""
    from exactstep.parallel.dcp_format import load_distributed_checkpoint

    engine = engine_for(ctx, strategy)
    before = full_params(engine)
    try:
        load_distributed_checkpoint(Path(path), model=engine.model,
                                    optimizer=engine.optimizer, ctx=ctx, strategy=strategy)
        error = None
    except DistributedError as exc:
        error = str(exc)
    after = full_params(engine)
    return {"saved": saved, "strategy": strategy, "error": error,
            "moved": any(not torch.equal(before[k], after[k]) for k in before)}


def zero_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """Every layout over ``job['windows']``, the round trips over ``job['checkpoint']``,
    the refusals; written to ``out/rank{rank}.pt``."""

    def body(ctx, result: dict) -> None:
        for name in LAYOUTS:
            result[name] = run_layout(ctx, rank, name, job["windows"])
        root = Path(out) / "checkpoints"
        trips = {s: round_trip(ctx, rank, s, job["checkpoint"], root)
                 for s in ("ddp", "zero1", "zero2")}
        result["round_trip"] = trips
        result["refused"] = [refused(ctx, trips[saved]["path"], saved, strategy)
                             for saved, strategy in (("zero1", "ddp"), ("ddp", "zero1"),
                                                     ("zero2", "zero1"))]

    run_rank(rank, world, port, out, ParallelConfig(timeout_s=30.0), body)
