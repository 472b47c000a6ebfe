"""The training run: build -> run windows -> finish. Orchestration only.

Wires the stages ``examples -> Batch -> row losses -> Objective | NoObjective ->
Disposition`` and calls three components: the ``Checkpointer`` (state), the
``Reporter`` (metrics, progress, summary) and the ``Validator`` (held-out
evaluation); everything a run writes lives in one run directory (S1, U4, S3, X3).
Design and derivations: docs/design/run.md#runrunnerpy (U4, S1, S3, S8, X3).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from exactstep.config import RunConfig
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import RESUME_AUTO_HINT, Interrupted, ResumeError
from exactstep.eval import Validator
from exactstep.families import FamilyParts, open_family
from exactstep.families import resolve as resolve_family
from exactstep.model.compiled import compile_model
from exactstep.model.decoder import activation_bytes, model_note, model_section
from exactstep.model.stages import split_decoder
from exactstep.parallel.agreement import agreed_stop, agreed_windows, distribute_engine
from exactstep.parallel.dcp_format import DcpFormat
from exactstep.parallel.launch import collective_guard
from exactstep.parallel.pipeline import (
    pipeline_engine,
    pipeline_stages,
    refuse_pipeline,
    refuse_split_stages,
)
from exactstep.parallel.process_group import DistContext, init_distributed, shutdown
from exactstep.parallel.reducer import build_reducer
from exactstep.parallel.storage import check_shared_run_dir, hold_run_dir
from exactstep.parallel.tensor import split_model
from exactstep.parallel.wrap import refuse_zero_layout, shard_model
from exactstep.rows.background import BackgroundStream
from exactstep.rows.example import DataBundle
from exactstep.rows.loader_process import LoaderProcess
from exactstep.rows.stream import RowStream
from exactstep.run.host_memory import pin_mmap_threshold, threshold_for
from exactstep.run.report import (
    LEDGER_FILE,
    METRICS_FILE,
    ROLLOUTS_FILE,
    Reporter,
    outcome_counts,
    write_outputs,
)
from exactstep.state import denormals, environment
from exactstep.state.checkpointer import Checkpointer
from exactstep.state.durable import Journal
from exactstep.state.manifest import Manifest, build_manifest, run_sections, write_manifest
from exactstep.state.resume import StopRequest
from exactstep.state.rng import seed_rng
from exactstep.tracking import RunIdentity, Tracker, build_trackers
from exactstep.update.groups import build_optimizer, resolve_groups
from exactstep.update.ledger import Ledger
from exactstep.update.precision import Precision, apply_fp32_matmul, resolve_device_numerics
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine


@dataclass
class Run:
    """Everything one training process holds. Built by ``build_run``."""

    cfg: RunConfig
    out_dir: Path
    tokenizer: ByteTokenizer
    data: DataBundle
    stream: RowStream | BackgroundStream | LoaderProcess
    model: torch.nn.Module
    engine: UpdateEngine
    validator: Validator
    checkpointer: Checkpointer
    manifest: Manifest
    ctx: DistContext
    parts: FamilyParts
    environment: dict[str, Any]  # the numerics environment this process runs in (S9)


# --------------------------------------------------------------------------- build


def build_run(cfg: RunConfig, out_dir: Path, *, parent: dict | None = None,
              ctx: DistContext | None = None) -> Run:
    """Construct every stage; nothing is written to disk here.

    Under torchrun (D1-D4) the process joins the job: the stream is sharded by rank
    (D3), the model is sharded when ``parallel.strategy = "fsdp"``, and the engine's
    reducer agrees D, the finite decision and the no-objective decision (D2).
    ``train.threads`` (0: PyTorch's count) and ``numerics.flush_denormal`` are set
    for the process here and the numerics environment recorded after them (S9);
    ``train.compile`` compiles the model's forward in place, its parameter names
    unchanged (``model.compiled``). The host allocator's threshold is pinned from the
    model's shapes once it is built (``host_memory.threshold_for``, L1).
    """
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    denormals.set_flush_denormal(cfg.numerics.flush_denormal)  # every thread (S9)
    pin_mmap_threshold()  # 6 MiB until the model's shapes are known (L1)
    seed_rng(cfg.seed)  # every stream starts from the seed; a resume restores them later
    ctx = ctx or init_distributed(cfg.parallel, cfg.train.device)
    with collective_guard(ctx):  # a rank refused here (a damaged shard) is a peer's
        return assemble_run(cfg, out_dir, ctx, parent)  # failure to the others (X4)


def assemble_run(cfg: RunConfig, out_dir: Path, ctx: DistContext, parent: dict | None
                 ) -> Run:
    """``build_run``'s stages once the process has joined the job; the collectives
    among them (DDP's parameter check, FSDP2's sharding) run under the caller's
    ``collective_guard``."""
    # "auto" numerics become what this device runs, before the manifest records them (S1)
    cfg = replace(cfg, numerics=resolve_device_numerics(cfg.numerics, ctx.device))
    cfg = resolve_family(cfg)  # the objective family explicit before the manifest (R8)
    apply_fp32_matmul(cfg.numerics, ctx.device)
    parts = open_family(cfg, share=(ctx.rank, ctx.world_size))  # each rank hashes a share
    tokenizer, data = parts.tokenizer, parts.data
    layout = ctx.layout  # the data shard is the replica's: every shard of it reads it (D3)
    stream = RowStream(data.train, cfg.batch, pad_id=tokenizer.pad_id, seed=cfg.seed,
                       vocab_size=tokenizer.vocab_size, rank=layout.dp_rank, world=layout.dp,
                       compiler=parts.compiler)
    if cfg.train.prefetch:  # the same batches and cursor, prepared ahead (P3)
        ahead = LoaderProcess if cfg.train.loader == "process" else BackgroundStream
        stream = ahead(stream, cfg.train.prefetch)
    model = parts.family.build_model(cfg, tokenizer.vocab_size)
    model.check_rows(cfg.batch.seq_len)  # refused before anything is written
    widest, kept = activation_bytes(model, cfg.batch.rows * cfg.batch.seq_len,
                                    tokenizer.vocab_size)
    pin_mmap_threshold(threshold_for(  # from the run's own shapes (L1)
        widest, kept if cfg.model.activation_checkpointing else None))
    refuse_split_stages(layout)  # before the tensor split: a stage is whole layers
    refuse_zero_layout(cfg.parallel.strategy, layout)  # zero1/zero2: not over stages
    model = split_model(model.to(ctx.device), layout, family=cfg.objective.family,
                        lora=cfg.model.lora.enabled, compiled=cfg.train.compile,
                        strategy=cfg.parallel.strategy)  # tensor parallel (D5), refused first
    if cfg.train.compile:
        compile_model(model, family=cfg.objective.family)
    whole = None  # the manifest's optimizer groups: the whole model's (S1)
    if layout.pp > 1:  # this process keeps its stages, one-process names (S7)
        whole = resolve_groups(model, cfg.update).digest
        model = pipeline_model(cfg, parts, model, layout, ctx.device)
    model = shard_model(model.to(ctx.device), ctx, cfg.parallel,
                        precision=cfg.numerics.precision)
    optimizer, groups = build_optimizer(model, cfg.update)
    schedule = build_schedule(cfg.update, total_windows=cfg.train.steps  # in updates (U5)
                              * parts.family.updates_per_window(cfg))
    precision = Precision(cfg.numerics, ctx.device)
    engine = UpdateEngine(model, optimizer, schedule, precision, cfg.update, cfg.objective,
                          device=ctx.device, pad_id=tokenizer.pad_id, reducer=build_reducer(ctx),
                          inputs=parts.family.inputs(cfg),
                          plan=parts.family.plan(cfg, layout.dp_rank),
                          program=parts.family.program(cfg, parts, model, ctx.device))
    if layout.pp > 1:  # the schedule runs each window's microbatches (D1, D2)
        pipeline_engine(engine, model, ctx, schedule=cfg.parallel.schedule,
                        group=layout.group("pp"), rows=cfg.batch.rows, seq_len=cfg.batch.seq_len)
    else:
        distribute_engine(engine, ctx, cfg.parallel)
    env = environment.capture(ctx.device, compiled=cfg.train.compile)
    manifest = build_manifest(run_sections(cfg, data, whole or groups.digest,  # S1: the
                                           layout.section(), parent,  # whole model's groups
                                           model_section(model), parts.family.objective(cfg),
                                           env))
    validator = Validator(model, data.train, data.val, cfg.batch, tokenizer.pad_id,
                          tokenizer.vocab_size, ctx.device, cfg.train.eval_tokens,
                          precision.autocast, tokenizer.byte_lengths(), parts.compiler,
                          getattr(engine.runner, "evaluate", None))
    checkpointer = Checkpointer(out_dir / "checkpoints", keep=cfg.checkpoint.keep, model=model,
                                engine=engine, stream=stream, ctx=ctx,
                                manifest_digest=manifest.digest,
                                multi_rank=DcpFormat(ctx, cfg.parallel.strategy),
                                environment=env)
    return Run(cfg, out_dir, tokenizer, data, stream, model, engine, validator, checkpointer,
               manifest, ctx, parts, env)


def pipeline_model(cfg: RunConfig, parts: FamilyParts, model: torch.nn.Module, layout,
                   device: torch.device) -> torch.nn.Module:
    """The stages ``layout.pp_rank`` runs of ``model`` (``split_decoder``), after the
    refusals (one ``ConfigError`` line, nothing written): a family with sequence-level
    inputs or an end-of-run score, ``train.compile``, any model but the built-in
    decoder."""
    refuse_pipeline(cfg.objective.family, compiled=cfg.train.compile,
                    program=parts.family.program(cfg, parts, model, device),
                    inputs=parts.family.inputs(cfg), scored=parts.family.score is not None)
    stages, n_stages = pipeline_stages(cfg.parallel.schedule, layout.pp, layout.pp_rank)
    return split_decoder(model, stages=stages, n_stages=n_stages)


# --------------------------------------------------------------------------- windows


def run_windows(run: Run, start: int, progress: bool,
                open_journals: Callable[[], tuple[Ledger | None, Journal | None]]) -> None:
    """Drive windows ``start .. train.steps-1``; checkpoint on cadence, on signals, at the end.

    The first window is built, and the trackers are opened, before ``open_journals``
    writes or announces anything, so a setting this machine cannot hold (or a tracker
    that cannot start) fails with the run's manifest and journals untouched.
    """
    cfg = run.cfg
    steps, every = cfg.train.steps, cfg.checkpoint.every
    reducer = run.engine.reducer if run.ctx.distributed else None
    windows = agreed_windows(iter(run.stream), cfg.update.accum, reducer, rows=cfg.batch.rows,
                             seq_len=cfg.batch.seq_len, pad_id=run.tokenizer.pad_id)
    with StopRequest() as stop, collective_guard(run.ctx), run.checkpointer.guard_writes(), \
            contextlib.closing(run.stream):  # a background worker stops with the windows
        batches = next(windows, None) if start < steps else None
        trackers = trackers_for(run, start)
        try:
            ledger, metrics = open_journals()
        except BaseException:
            for tracker in trackers:
                tracker.close()
            raise
        reporter = reporter_for(run, start, metrics, progress, trackers)
        window = start
        while batches is not None:
            disp = run.engine.run_window(batches, window)
            window += 1
            if ledger is not None:
                ledger.append(disp)
                rollouts = run.checkpointer.journals.get(ROLLOUTS_FILE)
                for record in run.engine.program.records if rollouts is not None else ():
                    rollouts.append(record)
            reporter.window(disp, sum(b.input_ids.numel() for b in batches),
                            run.engine.schedule.lr())
            if cfg.train.eval_every and window % cfg.train.eval_every == 0 and window < steps:
                reporter.evaluation(window, run.validator.record())
            stopping = agreed_stop(stop.requested, reducer)
            if (every and window % every == 0 and window < steps) or stopping:
                run.checkpointer.save(window)
            if stopping:
                reporter.close()
                raise Interrupted(
                    f"stopped by {stop.signal_name or 'a signal to another rank'} after window "
                    f"{window}; a checkpoint was published; continue with: {resume_command(run)}"
                )
            batches = next(windows, None) if window < steps else None
        reporter.close()
        run.checkpointer.save(window)


def resume_command(run: Run) -> str:
    """The ways to continue ``run``: ``exactstep resume``, or ``train --resume auto`` (S10)."""
    world = run.ctx.world_size
    nproc = f" --nproc {world}" if world > 1 else ""
    return f"exactstep resume {run.out_dir}{nproc}, {RESUME_AUTO_HINT}"


def finish(run: Run, started: float) -> dict[str, Any]:
    """Evaluate, then (rank 0) write the summary, data report and loss curve."""
    engine = run.engine
    summary = {
        "windows": {"committed": engine.committed, "skipped_nonfinite": engine.skipped,
                    "no_objective": engine.no_objective},
        "supervised_tokens": engine.tokens,
        "wall_s": time.perf_counter() - started,
        **run.validator.summary(),
        "data": run.stream.report(),
        "manifest_digest": run.manifest.digest,
    }
    if run.parts.family.score is not None:
        summary.update(run.parts.family.score(run.model, run.parts, run.cfg, run.ctx.device))
    if run.ctx.is_main:
        write_outputs(run.out_dir, summary, run.stream.report())
    return summary


def trackers_for(run: Run, start: int) -> list[Tracker]:
    """Rank 0's trackers for this start of the run (none on other ranks)."""
    if not run.ctx.is_main:
        return []
    return build_trackers(run.cfg.log, run.out_dir, identity_of(run, start))


def reporter_for(run: Run, start: int, metrics: Journal | None, progress: bool,
                 trackers: Sequence[Tracker]) -> Reporter:
    e = run.engine
    return Reporter(total=run.cfg.train.steps, start=start, log_every=run.cfg.train.log_every,
                    counts=outcome_counts(e.committed, e.skipped, e.no_objective),
                    metrics=metrics, progress=progress and run.cfg.train.progress
                    and run.ctx.is_main, trackers=trackers)


def identity_of(run: Run, start: int) -> RunIdentity:
    """What the trackers name this start of the run by (``exactstep.tracking``)."""
    return RunIdentity(name=Path(run.out_dir).resolve().name, digest=run.manifest.digest,
                       config=run.manifest.to_dict()["config"], start=start)


# --------------------------------------------------------------------------- entry points


def train(cfg: RunConfig, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """A new run in ``out_dir``. Refuses a directory that already holds another run, or
    that another process works in (``hold_run_dir``).

    ``out_dir`` gets ``manifest.json`` (S1, before step 1), ``ledger.jsonl`` (U4),
    ``metrics.jsonl`` and ``loss.png`` (X3), ``data_report.json`` (R4),
    ``summary.json``, ``checkpoints/`` with ``LATEST`` (S3, S8) and, while a command
    works in it, ``.exactstep.lock``."""
    started = time.perf_counter()
    with hold_run_dir(out_dir, "--out", new=True), environment.numerics_restored():
        run = build_run(cfg, out_dir)
        try:
            check_shared_run_dir(run.ctx, out_dir)  # every node sees it, before window 0
            return train_new(run, started, progress)
        finally:
            shutdown(run.ctx)


def train_new(run: Run, started: float, progress: bool) -> dict[str, Any]:
    """Manifest, empty journals, every window from 0, finish."""
    notes = [f"{run.model.num_parameters():,} parameters on {run.ctx.device} x "
             f"{run.ctx.world_size}, {len(run.data.train)} train / {len(run.data.val)} val "
             f"documents, manifest {run.manifest.digest[:12]}, run dir {run.out_dir}",
             model_note(run.model)]
    run_windows(run, 0, progress, lambda: start_journals(run, notes))
    return finish(run, started)


def start_journals(run: Run, notes: Sequence[str | None] = (), *, fresh_manifest: bool = True
                   ) -> tuple[Ledger | None, Journal | None]:
    """Rank 0: write the immutable manifest (S1), start empty journals, print ``notes``."""
    if not run.ctx.is_main:
        return None, None
    ledger_path = run.out_dir / LEDGER_FILE
    if fresh_manifest and ledger_path.exists() and ledger_path.stat().st_size:
        raise ResumeError(f"{run.out_dir} already holds a run; use 'exactstep resume "
                          f"{run.out_dir}' or choose a new --out")
    write_manifest(run.out_dir, run.manifest)
    ledger = Ledger.create(ledger_path)
    metrics = Journal.create(run.out_dir / METRICS_FILE, exact=False)
    rollouts = (Journal.create(run.out_dir / ROLLOUTS_FILE)
                if run.engine.program is not None else None)
    announce(notes)
    return attach(run, ledger, metrics, rollouts)


def announce(notes: Sequence[str | None]) -> None:
    for line in filter(None, notes):
        print(f"exactstep: {line}", file=sys.stderr)


def attach(run: Run, ledger: Ledger, metrics: Journal, rollouts: Journal | None = None
           ) -> tuple[Ledger, Journal]:
    """The journals a checkpoint marks (S8): the ledger, the metrics and, for a family
    with rollouts, one line per sample (``rollouts.jsonl``, Q2)."""
    run.checkpointer.journals = {LEDGER_FILE: ledger, METRICS_FILE: metrics}
    if rollouts is not None:
        run.checkpointer.journals[ROLLOUTS_FILE] = rollouts
    return ledger, metrics


__all__ = ["train"]
