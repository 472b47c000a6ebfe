"""Wrapping for many processes: DDP, ZeRO-1, ZeRO-2 or FSDP2 (ZeRO-3) (D1, D4).

``wrap_train_module`` puts the update engine's ``TrainModule`` (loss included) under
DDP so ``no_sync`` covers forward and backward (``ddp`` and ``zero1``, D1);
``parallel.zero`` replaces a ``zero1`` run's optimizer by PyTorch's
``ZeroRedundancyOptimizer`` over the same groups (optimizer state sharded);
``shard_model`` applies FSDP2 ``fully_shard`` per block (the built-in decoder's layers,
an HF model's decoder layers, LoRA adapters included) and at the root, before the
optimizer is built (``fsdp``; ``zero2`` keeps parameters gathered from forward to
backward, D4). Design: docs/design/parallel.md#parallelwrappy (D1, D4, U2, U4, U6).
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from exactstep.errors import DistributedError
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import DistContext
from exactstep.parallel.tensor import fsdp_placement

REPLICATED = ("ddp", "zero1")  # every rank holds every parameter: DDP wraps the module
SHARDED = ("fsdp", "zero2")  # FSDP2 shards the parameters (and gradients, state)


def refuse_zero_layout(strategy: str, layout) -> None:  # noqa: ANN001 - a Layout
    """``DistributedError`` for ``zero1`` / ``zero2`` where they do not run, before
    anything is built: over pipeline stages (the pipeline's runner reduces each stage's
    gradients itself; neither ZeRO engine is wired into it)."""
    if strategy in ("zero1", "zero2") and layout.pp > 1:
        raise DistributedError(
            f"parallel.strategy = '{strategy}' does not shard a pipeline (parallel.pp = "
            f"{layout.pp}): its stages' optimizers are not sharded; set parallel.strategy "
            "= 'ddp'")


def wrap_train_module(module: nn.Module, ctx: DistContext, cfg: ParallelConfig) -> nn.Module:
    """DDP around ``module`` for a replicated (``ddp``, ``zero1``) run; unchanged otherwise.

    A single process, or an ``fsdp`` / ``zero2`` run (sharded by ``shard_model``
    beforehand), returns ``module`` as it is. DDP broadcasts rank 0's parameters at
    construction, so every replica starts from the same weights.
    """
    if not ctx.distributed or cfg.strategy not in REPLICATED or ctx.layout.dp == 1:
        return module  # one replica (its ranks tensor shards): nothing to replicate
    return DistributedDataParallel(
        module,
        device_ids=None,  # the engine moves each batch itself; DDP must not touch it
        bucket_cap_mb=cfg.bucket_mb,
        find_unused_parameters=False,  # every parameter is used every microbatch (D1)
    )


def unwrap(module: nn.Module) -> nn.Module:
    """The module DDP wraps (or ``module`` itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def fsdp_mixed_precision(precision: str):
    """FSDP2's ``MixedPrecisionPolicy`` for a resolved ``numerics.precision`` (U2, D4).

    ``bf16``: parameters all-gathered and used in bf16, gradients reduce-scattered in
    fp32 (the sharded fp32 master weights and optimizer state are unchanged). Every
    other precision keeps FSDP2's default (no cast: fp32 parameters, autocast does
    the per-op casting, as without sharding).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one, in model order (D4).

    The built-in decoder's ``layers``; otherwise (an HF causal LM, with or without
    peft's LoRA wrapper) every outermost module whose class one of the model's
    ``_no_split_modules`` names (its decoder layers, as Hugging Face marks them for
    sharding). Nothing found: the root alone is sharded.
    """
    layers = getattr(model, "layers", None)
    if layers is not None:
        return list(layers)
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    inside: set[int] = set()  # ids of the modules within a block already taken
    for module in model.modules():  # pre-order: a block comes before what it holds
        if id(module) in inside or type(module).__name__ not in names:
            continue
        blocks.append(module)
        inside.update(id(m) for m in module.modules())
    return blocks


def shard_model(model: nn.Module, ctx: DistContext, cfg: ParallelConfig, *,
                precision: str = "fp32") -> nn.Module:
    """FSDP2: ``fully_shard`` every block of ``shard_blocks(model)``, then ``model`` (D4).

    ``fsdp`` (ZeRO-3) reshards each block's parameters after its forward and gathers
    them again for its backward; ``zero2`` (``reshard_after_forward=False``, FSDP1's
    ``SHARD_GRAD_OP``) keeps them gathered from a block's forward to its backward (one
    all-gather per microbatch, not two). Both reduce-scatter the gradients and keep
    sharded gradients, optimizer state and, between windows, parameters.

    ``precision`` is the run's resolved ``numerics.precision``
    (``fsdp_mixed_precision``). A single process (e.g. a 2 -> 1 ``--reshard``)
    holds every parameter itself: ``model`` is returned unsharded, as ``ddp`` runs
    one process unwrapped, and one line on stderr says so. Raises ``DistributedError``
    when the device/backend pair cannot run FSDP2. The root keeps its parameters
    (embedding, tied head, final norm) gathered between forward and backward, so the
    objective can use the head weight after the model's forward.

    Call it *before* the optimizer is built: it replaces the parameters with sharded
    ``DTensor``s. Its mesh is the default process group, so every collective keeps the
    ``parallel.timeout_s`` bound.
    """
    if cfg.strategy not in SHARDED:
        return model
    if not ctx.distributed:
        print(f"exactstep: parallel.strategy = {cfg.strategy} in one process: the model runs "
              "unsharded (every parameter here); launch several processes (--nproc, "
              "torchrun) to shard", file=sys.stderr)
        return model
    if ctx.layout.dp == 1 and not ctx.layout.only_data:
        if ctx.is_main:
            print(f"exactstep: parallel.strategy = {cfg.strategy} with one data replica: "
                  "nothing to shard over (the replica's ranks are its tensor shards); launch "
                  "more processes to shard over replicas", file=sys.stderr)
        return model
    if ctx.device.type != "cuda" and ctx.backend != "gloo":
        raise DistributedError("FSDP2 on CPU needs the gloo backend; set parallel.backend = 'gloo'")
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        # the default group as the mesh: init_device_mesh would create a group without
        # the job's timeout when CUDA is visible but the job runs on gloo; a replica split
        # into tensor shards is sharded over the layout's dp dimension (2-D with tp)
        mesh = (DeviceMesh.from_group(dist.group.WORLD, ctx.device.type)
                if ctx.layout.only_data else ctx.layout.submesh("dp"))
        kwargs = {"mp_policy": fsdp_mixed_precision(precision)}
        if ctx.layout.tp > 1:  # fused weights strided over tp: sharded over dp on dim 1
            kwargs["shard_placement_fn"] = fsdp_placement
        keep = cfg.strategy == "zero2"  # parameters gathered from forward to backward
        for block in shard_blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=not keep, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
    except (RuntimeError, NotImplementedError, AssertionError) as exc:
        raise DistributedError(
            f"FSDP2 (fully_shard) is not available on {ctx.device.type} with backend "
            f"{ctx.backend} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            "use parallel.strategy = 'ddp' here, or run on CUDA with nccl"
        ) from None
    return model
