"""Spawned pipeline ranks for tests/parallel/test_pipeline_parallel.py (D1, D2, S7).

A rank builds the whole seeded decoder, keeps its stages (``split_decoder``), makes its
engine a pipeline rank and runs each of the job's phases on a fresh engine; it writes
its parameters (logical names), ledger and, where asked, a checkpoint. Planted wrong
variants (negative controls) are chosen by name in the phase.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from workers import (
    OBJECTIVE,
    PAD_ID,
    UPDATE,
    VOCAB,
    common_state,
    load_common,
    run_phases,
    stream_for,
)

from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.model.stages import split_decoder
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.dcp_format import load_distributed_checkpoint, save_distributed_checkpoint
from exactstep.parallel.pipeline import (
    PipelineRunner,
    pipeline_engine,
    pipeline_stages,
)
from exactstep.parallel.reducer import DDPReducer
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

ROWS, SEQ = 2, 8


def model_cfg(n_layers: int = 2, tied: bool = False) -> ModelConfig:
    return ModelConfig(d_model=16, n_layers=n_layers, n_heads=2, d_ff=32, attention="dense",
                       tie_embeddings=tied)


def engine_on(model: torch.nn.Module, update: UpdateConfig) -> UpdateEngine:
    optimizer, _ = build_optimizer(model, update)
    return UpdateEngine(model, optimizer, build_schedule(update, total_windows=100),
                        Precision(NumericsConfig(), "cpu"), update, OBJECTIVE,
                        device=torch.device("cpu"), pad_id=PAD_ID)


def one_process_engine(n_layers: int, tied: bool, update: UpdateConfig = UPDATE,
                       dtype: torch.dtype = torch.float32) -> UpdateEngine:
    """The same model in one process (``dtype`` float64: the reference run)."""
    return engine_on(build_model(model_cfg(n_layers, tied), VOCAB, seed=0).to(dtype), update)


class GradRecordingRunner(PipelineRunner):
    """The right runner, keeping a copy of the window's gradients (before the clip)."""

    def run(self, engine, *args, **kwargs):
        out = super().run(engine, *args, **kwargs)
        self.grads.append({n: p.grad.detach().clone()
                           for n, p in self.model.named_parameters() if p.grad is not None})
        return out


class ScheduleMeanRunner(GradRecordingRunner):
    """The right loss with the schedule's default ``scale_grads=True`` (what the schedule
    does to the gradients, measured)."""

    scale_grads = True


class MeanPerMicrobatchRunner(ScheduleMeanRunner):
    """Deliberately wrong (negative control): the schedule's own convention, each
    microbatch's loss a mean over its own tokens (``S_m / D_m``) and the gradients
    divided by the microbatch count (``scale_grads=True``)."""

    def _loss(self, hidden, target):
        d_m = float(self.current[int(target[0])].coeff.sum()) or 1.0
        return super()._loss(hidden, target) / (self._loss_scale * d_m)


class LocalNormRunner(PipelineRunner):
    """Deliberately wrong (negative control): each stage clips by its own stage's norm."""

    def grad_norm(self, engine):
        grads = [p.grad for p in self.model.norm_parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, 2.0).float()


class UnagreedFlagReducer(DDPReducer):
    """Deliberately wrong (negative control for D2): the finite flag stays on its stage."""

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        return values.clone()  # [bad flag, S, NLL], this rank's own


class ReplicaLocalRunner(PipelineRunner):
    """Deliberately wrong (negative control for D1): each data replica steps on its own
    gradient, never averaged with the other replicas'."""

    def _mean_over_replicas(self) -> None:
        pass


RUNNERS = {"replica_local": ReplicaLocalRunner, "record": GradRecordingRunner, "schedule_mean": ScheduleMeanRunner,
           "mean_per_microbatch": MeanPerMicrobatchRunner, "local_norm": LocalNormRunner}


def build_pipeline_engine(ctx, phase: dict, rank: int) -> UpdateEngine:
    update = replace(UPDATE, accum=phase.get("accum", UPDATE.accum),
                     fail_window=phase.get("fail_window", {}).get(rank, -1))
    decoder = build_model(model_cfg(phase["layers"], phase.get("tied", False)), VOCAB, seed=0)
    stages, n_stages = pipeline_stages(phase["schedule"], ctx.layout.pp, ctx.layout.pp_rank)
    model = split_decoder(decoder, stages=stages, n_stages=n_stages)
    engine = engine_on(model, update)
    pipeline_engine(engine, model, ctx, schedule=phase["schedule"], rows=ROWS, seq_len=SEQ)
    if phase.get("reducer") == "unagreed_flag":
        engine.reducer = UnagreedFlagReducer(ctx)
    other = RUNNERS.get(phase.get("runner", ""))
    if other is not None:
        right = engine.runner
        engine.runner = other(model, schedule=phase["schedule"], n_microbatches=update.accum,
                              group=right.group, device=right.device,
                              objective_cfg=right.objective_cfg, pad_id=PAD_ID,
                              terms=right.terms, precision=right.precision, rows=ROWS, seq_len=SEQ,
                              tied_group=right.tied_group, replica_group=right.replica_group)
        engine.runner.grads = []
    return engine


def run_pipeline_phase(rank: int, ctx, phase: dict) -> dict:
    """The phase's windows (from ``phase["first"]``, after loading ``phase["load"]``
    where given), then a checkpoint to ``phase["save"]`` where given."""
    engine = build_pipeline_engine(ctx, phase, rank)
    if "replica_windows" in phase:  # this data replica's share of every window
        phase = {**phase, "windows": phase["replica_windows"][ctx.layout.dp_rank]}
    first = phase.get("first", 0)
    if "load" in phase:  # weights_only: a control that drops the optimizer and schedule
        state = load_distributed_checkpoint(
            Path(phase["load"]), model=engine.model,
            optimizer=None if phase.get("weights_only") else engine.optimizer, ctx=ctx)
        if state is not None:
            load_common(engine, state.common)
    records, after = [], []
    for w, batches in enumerate(phase["windows"][first:], start=first):
        records.append(engine.run_window(list(batches), w).ledger_record())
        after.append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
    held_out = None
    if "eval" in phase:  # held-out batches, the evaluation's token limit
        held_out = engine.runner.evaluate(iter(phase["eval"][0]), phase["eval"][1])
    if "save" in phase:  # every stage the same data cursor: one data replica (D3)
        save_distributed_checkpoint(
            Path(phase["save"]).parent, Path(phase["save"]).name, model=engine.model,
            optimizer=engine.optimizer, common=common_state(engine),
            rank_state={"data": stream_for(0, 1).state_dict()}, ctx=ctx, keep=2)
    return {"params": after, "ledger": records, "eval": held_out,
            "grads": getattr(engine.runner, "grads", None),
            "optimizer": get_optimizer_state_dict(engine.model, engine.optimizer),
            "coords": ctx.layout.coords(),
            "optimizer_steps": [int(s["step"]) for s in engine.optimizer.state_dict()["state"]
                                .values() if "step" in s]}


def pipeline_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One pipeline rank: every phase of ``job`` in turn, results to ``rank<r>.pt``."""
    cfg = ParallelConfig(timeout_s=job.get("timeout_s", 60.0), pp=job.get("pp", world))
    run_phases(rank, world, port, out, cfg, job["phases"],
               lambda ctx, phase: run_pipeline_phase(rank, ctx, phase))
