"""Spawned ranks for the tensor-parallel proofs (D4, D5, U3): tiny models, gloo, one thread.

A rank builds the model from the seed, splits it over the layout's ``tp`` mesh
(``exactstep.parallel.tensor.parallelize``, or a planted wrong variant), runs the
job's windows through the update engine and writes every parameter gathered whole
after each window, with the ledger. The one-process runs the parent compares with
are built here too (``reference_run``), in fp32 and in float64.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from workers import MODEL, OBJECTIVE, PAD_ID, VOCAB, run_rank

from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.parallel.config import ParallelConfig
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

#: two blocks, four heads (two a rank at tp = 2), an untied head
BUILTIN = replace(MODEL, n_layers=2, n_heads=4, tie_embeddings=False)
#: a tiny Llama: grouped-query attention (4 query heads, 2 key/value heads), tied head
LLAMA = ModelConfig(source="hf", attn_implementation="sdpa", hf_config={
    "model_type": "llama", "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
    "tie_word_embeddings": True, "max_position_embeddings": 64})
MODELS = {"builtin": BUILTIN, "llama": LLAMA}
#: SGD: an update linear in the clipped gradient, so a wrong norm or a wrong gradient
#: shows in the parameters after one window (Adam's first step is about lr * sign(g));
#: clip 0.5 below every window's norm, so the clip acts every time
UPDATE = UpdateConfig(accum=2, optimizer="sgd", lr=0.1, momentum=0.9, warmup=0,
                      schedule="constant", clip=0.5, weight_decay=0.1)


def build_engine(model: nn.Module, engine_cls=UpdateEngine, reducer=None) -> UpdateEngine:
    from exactstep.update.groups import build_optimizer

    optimizer, _ = build_optimizer(model, UPDATE)
    return engine_cls(model, optimizer, build_schedule(UPDATE, total_windows=100),
                      Precision(NumericsConfig(), "cpu"), UPDATE, OBJECTIVE,
                      device=torch.device("cpu"), pad_id=PAD_ID, reducer=reducer)


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole, by its logical name."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().clone().double()
    return out


def run(engine: UpdateEngine, windows) -> tuple[list[dict], list[dict]]:
    """Each window's ledger record and the parameters after it."""
    ledger, params = [], []
    for w, batches in enumerate(windows):
        ledger.append(engine.run_window(list(batches), w).ledger_record())
        params.append(whole(engine.model))
    return ledger, params


def reference_run(name: str, windows, dtype: torch.dtype) -> dict:
    """The one-process run of the same model and windows, in ``dtype``."""
    model = build_model(MODELS[name], VOCAB, seed=0).to(dtype)
    ledger, params = run(build_engine(model), windows)
    return {"ledger": ledger, "params": params}


# ---------------------------------------------------------------- planted wrong variants


class NormsCountedTwiceEngine(UpdateEngine):
    """Deliberately wrong (negative control for U3/D4): the clip norm sums every
    rank's local squared norms over all ranks, so a parameter replicated over ``tp``
    (the norms' weights) is counted once per tensor shard."""

    def _grad_norm(self) -> torch.Tensor:
        local = sum(g.to_local().double().pow(2).sum() for g in self._grads())
        dist.all_reduce(local)
        return local.sqrt().float()


def unreduced_norms(model: nn.Module, mesh) -> None:
    """Deliberately wrong (negative control for sequence parallel): after the right
    split, each block's norms run on this rank's token rows with the local weight, and
    their weight gradient is declared replicated without the sum over the other ranks'
    rows (``to_local`` with its default gradient placement)."""
    from torch.distributed.tensor import Shard

    norms = ([m for b in model.layers for m in (b.attn_norm, b.mlp_norm)]
             if hasattr(model, "layers") else
             [m for b in model.decoder.layers
              for m in (b.input_layernorm, b.post_attention_layernorm)])
    for norm in norms:
        norm._forward_pre_hooks.clear()
        norm._forward_hooks.clear()
        rms = isinstance(norm, nn.RMSNorm)

        def forward(x, norm=norm, rms=rms):
            x = x.to_local() if hasattr(x, "to_local") else x  # this rank's rows
            w = norm.weight.to_local()  # grad declared Replicate: never summed over rows
            if rms:
                y = F.rms_norm(x, norm.normalized_shape, w, norm.eps)
            else:
                y = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                         + norm.variance_epsilon))
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(y, mesh, [Shard(1)], run_check=False)

        norm.forward = forward


# ---------------------------------------------------------------- one rank


def tp_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """``job``: ``model`` (builtin | llama), ``tp``, ``windows[dp_rank]``, ``variants``
    (right | norms_twice | unreduced_norms), ``strategy``. Writes, per variant, the
    ledger and the gathered parameters after each window."""
    from exactstep.parallel.agreement import distribute_engine
    from exactstep.parallel.tensor import parallelize
    from exactstep.parallel.wrap import shard_model

    cfg = ParallelConfig(timeout_s=60.0, tp=job["tp"], strategy=job.get("strategy", "ddp"))

    def body(ctx, result: dict) -> None:
        layout = ctx.layout
        mesh = layout.submesh("tp")
        for variant in job["variants"]:
            model = parallelize(build_model(MODELS[job["model"]], VOCAB, seed=0), mesh)
            if variant == "unreduced_norms":
                unreduced_norms(model, mesh)
            model = shard_model(model, ctx, cfg)  # FSDP2 over dp (strategy fsdp)
            cls = NormsCountedTwiceEngine if variant == "norms_twice" else UpdateEngine
            engine = distribute_engine(build_engine(model, cls), ctx, cfg)
            if variant == "checkpoint":
                result[variant] = checkpointed(engine, job, ctx, mesh)
                continue
            ledger, params = run(engine, job["windows"][layout.dp_rank])
            result[variant] = {"ledger": ledger, "params": params}

    run_rank(rank, world, port, out, cfg, body)


#: what a checkpoint's per-rank part holds besides the RNG: a data cursor at epoch 0
#: (the engine-level runs here feed their windows by hand)
NO_DATA = {"planner": {"epoch": 0, "pending": []}}


def checkpointed(engine: UpdateEngine, job: dict, ctx, mesh) -> dict:
    """Two windows, a checkpoint (``job['root']``), the third window (``straight``);
    then a fresh model from another seed, split the same way, loads the checkpoint and
    runs the third window (``resumed``)."""
    from workers import common_state, load_common

    from exactstep.parallel.dcp_format import (
        load_distributed_checkpoint,
        save_distributed_checkpoint,
    )
    from exactstep.parallel.tensor import parallelize

    windows = job["windows"][0]
    first, _ = run(engine, windows[:2])
    save_distributed_checkpoint(Path(job["root"]), "window-00000002", model=engine.model,
                                optimizer=engine.optimizer, common=common_state(engine),
                                rank_state={"data": NO_DATA}, ctx=ctx, keep=2)
    straight = engine.run_window(list(windows[2]), 2).ledger_record()
    out = {"straight": {"ledger": first + [straight], "params": whole(engine.model)}}
    model = parallelize(build_model(MODELS[job["model"]], VOCAB, seed=7), mesh)
    fresh = build_engine(model, reducer=engine.reducer)  # tp only: no wrapper to copy
    state = load_distributed_checkpoint(Path(job["root"]) / "window-00000002", model=model,
                                        optimizer=fresh.optimizer, ctx=ctx)
    load_common(fresh, state.common)
    resumed = fresh.run_window(list(windows[2]), 2).ledger_record()
    out["resumed"] = {"ledger": first + [resumed], "params": whole(model)}
    # negative control: the weights alone (a fresh optimizer, no momentum)
    model = parallelize(build_model(MODELS[job["model"]], VOCAB, seed=7), mesh)
    control = build_engine(model, reducer=engine.reducer)
    load_distributed_checkpoint(Path(job["root"]) / "window-00000002", model=model,
                                optimizer=None, ctx=ctx)
    load_common(control, state.common)
    control.run_window(list(windows[2]), 2)
    out["control"] = {"params": whole(model)}
    return out


def plain_fused_shards(model: nn.Module, mesh) -> None:
    """Deliberately wrong (negative control for whole heads): the fused ``qkv`` and
    ``gate_up`` column-sharded as plain linears (``Shard(0)``): rank 0 gets every query
    row and half the key rows, never a head's q, k and v together."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from exactstep.parallel.tensor import decoder_plan, shard_head

    plan = decoder_plan(model)
    for name in plan:
        if name.endswith((".qkv", ".gate_up")):
            plan[name] = ColwiseParallel()
    parallelize_module(model, mesh, plan)
    shard_head(model, mesh)


def heads_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """Forward + backward of one batch through the built-in decoder split over ``tp``
    (``right``) and with plainly sharded fused weights (``plain``): the local fused
    weights, the head count the attention kernel saw, the hidden states and the
    numerator's gradients gathered whole."""
    import exactstep.model.decoder as decoder_module
    from exactstep.parallel.tensor import parallelize
    from exactstep.update.window import TrainModule

    cfg = ParallelConfig(timeout_s=60.0, tp=2)

    def body(ctx, result: dict) -> None:
        mesh = ctx.layout.submesh("tp")
        seen: list[tuple[int, ...]] = []
        kernel = decoder_module.attend_fused

        def recording(qkv, vis):
            seen.append(tuple(qkv.shape))
            return kernel(qkv, vis)

        decoder_module.attend_fused = recording
        batch = job["batch"]
        for variant in ("right", "plain"):
            seen.clear()
            model = build_model(BUILTIN, VOCAB, seed=0)
            if variant == "right":
                parallelize(model, mesh)
            else:
                plain_fused_shards(model, mesh)
            module = TrainModule(model, OBJECTIVE, pad_id=PAD_ID)
            numerator, _ = module(batch, (batch.labels != -100).float())
            numerator.backward()
            block = model.layers[0]
            result[variant] = {
                "qkv": block.attn.qkv.weight.to_local().detach().clone(),
                "gate_up": block.mlp.gate_up.weight.to_local().detach().clone(),
                "kernel_shapes": list(seen),
                "hidden": model(batch).detach().double(),
                "grads": {n: p.grad.full_tensor().double() for n, p in model.named_parameters()},
            }

    run_rank(rank, world, port, out, cfg, body)
