"""The training run: builds every stage from a ``RunConfig`` and drives windows.

Data flows ``examples -> Batch -> row losses -> Objective | NoObjective ->
Disposition``; this module only wires the stages and owns the run directory:

    RUN/manifest.json     immutable manifest + digest (S1), written before step 1
    RUN/ledger.jsonl      one line per window (U4)
    RUN/metrics.jsonl     interval metrics and evaluations (X3)
    RUN/loss.png          loss curve (X3)
    RUN/data_report.json  packing outcomes and efficiency (R4)
    RUN/summary.json      end-of-run summary
    RUN/checkpoints/      atomically published checkpoints + LATEST (S3)
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exactstep import __version__
from exactstep.config import RunConfig, build, load_config, set_dotted, split_override
from exactstep.data.corpus import load_corpus
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError, DistributedError, Interrupted, ResumeError
from exactstep.eval import EvalResult, evaluate, unigram_bits
from exactstep.manifest import (
    Manifest,
    build_manifest,
    diff_manifests,
    read_manifest,
    write_manifest,
)
from exactstep.model.decoder import build_model
from exactstep.objective.perplexity import NotAvailable
from exactstep.parallel.checkpoint import (
    load_distributed_checkpoint,
    reshard_record,
    reshard_stream_state,
    save_distributed_checkpoint,
)
from exactstep.parallel.launch import collective_guard
from exactstep.parallel.process_group import DistContext, init_distributed, shutdown
from exactstep.parallel.reducer import build_reducer
from exactstep.parallel.window import agreed_window, distribute_engine
from exactstep.parallel.wrap import shard_model
from exactstep.rows.example import DataBundle, encode_documents
from exactstep.rows.stream import RowStream, eval_batches
from exactstep.state.checkpoint import (
    clean_uncommitted,
    is_distributed_checkpoint,
    load_checkpoint,
    publish_checkpoint,
)
from exactstep.state.resume import (
    StopRequest,
    check_progress_digest,
    choose_checkpoint,
    classify_resume,
)
from exactstep.state.rng import capture_rng, restore_rng, seed_rng
from exactstep.update.disposition import Disposition, Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.ledger import Ledger
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

# Keys that change presentation only; they are left out of the manifest so that a
# resume may change them (S4).
PRESENTATION_KEYS = ("train.progress", "train.log_every", "train.threads")


@dataclass
class Run:
    """Everything one training process holds. Built by ``build_run``."""

    cfg: RunConfig
    out_dir: Path
    device: torch.device
    tokenizer: ByteTokenizer
    data: DataBundle
    stream: RowStream
    model: torch.nn.Module
    engine: UpdateEngine
    precision: Precision
    manifest: Manifest
    ctx: DistContext
    group_table: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)  # ledger events, e.g. RESHARD (S7)

    @property
    def checkpoints(self) -> Path:
        return self.out_dir / "checkpoints"


# --------------------------------------------------------------------------- build


def build_data(cfg: RunConfig, tokenizer: ByteTokenizer) -> DataBundle:
    """Load and encode both splits. Chat data comes from the chat compiler (R5)."""
    if cfg.data.kind == "chat":
        from exactstep.rows.chat_source import load_chat_data

        return load_chat_data(cfg, tokenizer)
    corpus = load_corpus(cfg.data)
    section = {
        "source": corpus.source,
        "kind": cfg.data.kind,
        "fingerprint": corpus.fingerprint,
        "split": corpus.split_rule,
        "train_documents": len(corpus.train),
        "val_documents": len(corpus.val),
    }
    representation = {
        "tokenizer": "bytes",
        "tokenizer_hash": tokenizer.fingerprint(),
        "special_ids": tokenizer.special_ids(),
        "template_hash": None,
    }
    return DataBundle(
        train=encode_documents(corpus.train, tokenizer),
        val=encode_documents(corpus.val, tokenizer),
        section=section,
        representation=representation,
    )


def manifest_sections(
    cfg: RunConfig, data: DataBundle, group_digest: str, world_size: int,
    parent: dict | None = None,
) -> dict[str, Any]:
    """The S1 sections. The resolved configuration is recorded whole (X2)."""
    config = cfg.to_dict()
    for key in PRESENTATION_KEYS:
        section, name = key.split(".")
        config[section].pop(name, None)
    family = "chat_sft" if cfg.data.kind == "chat" else "causal_lm"
    sections: dict[str, Any] = {
        "config": config,
        "data": data.section,
        "representation": data.representation,
        "batch": dataclasses.asdict(cfg.batch),
        "objective": {
            "family": family,
            "shift_owner": "collator",
            "ownership": "assistant_targets" if family == "chat_sft" else "all_next_tokens",
            "ignore_index": -100,
            "smoothing": cfg.objective.smoothing,
            "label_smoothing": cfg.objective.label_smoothing,
            "reduction": cfg.objective.reduction,
        },
        "update": {**dataclasses.asdict(cfg.update), "group_digest": group_digest},
        "numerics": dataclasses.asdict(cfg.numerics),
        "parallel": {**dataclasses.asdict(cfg.parallel), "world_size": world_size},
        "seeds": {"seed": cfg.seed},
        "code": {
            "exactstep": __version__,
            "torch": torch.__version__.split("+")[0],
            "python": platform.python_version(),
        },
    }
    if parent is not None:
        sections["parent"] = parent
    return sections


def build_run(cfg: RunConfig, out_dir: Path, *, parent: dict | None = None,
              ctx: DistContext | None = None) -> Run:
    """Construct every stage; nothing is written to disk here.

    Under torchrun (D1-D4) the process joins the job: the stream is sharded by rank
    (D3), the model is sharded when ``parallel.strategy = "fsdp"``, and the engine's
    reducer agrees D, the finite decision and the no-objective decision (D2).
    """
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_rng(cfg.seed)  # every stream starts from the seed; a resume restores them later
    ctx = ctx or init_distributed(cfg.parallel, cfg.train.device)
    device = ctx.device
    tokenizer = ByteTokenizer()
    data = build_data(cfg, tokenizer)
    stream = RowStream(data.train, cfg.batch, pad_id=tokenizer.pad_id, seed=cfg.seed,
                       vocab_size=tokenizer.vocab_size, rank=ctx.rank, world=ctx.world_size)
    model = build_model(cfg.model, tokenizer.vocab_size, seed=cfg.seed).to(device)
    model = shard_model(model, ctx, cfg.parallel)
    optimizer, groups = build_optimizer(model, cfg.update)
    slots_per_window = cfg.batch.rows * cfg.batch.seq_len * cfg.update.accum * ctx.world_size
    schedule = build_schedule(cfg.update, total_windows=cfg.train.steps,
                              tokens_per_window=slots_per_window)
    precision = Precision(cfg.numerics, device)
    engine = UpdateEngine(
        model, optimizer, schedule, precision, cfg.update, cfg.objective,
        device=device, pad_id=tokenizer.pad_id, reducer=build_reducer(ctx),
    )
    distribute_engine(engine, ctx, cfg.parallel)
    sections = manifest_sections(cfg, data, groups.digest, ctx.world_size, parent)
    return Run(cfg, out_dir, device, tokenizer, data, stream, model, engine, precision,
               build_manifest(sections), ctx, groups.table)


# --------------------------------------------------------------------------- state


# Checkpoint part names (what ``checkpoint verify`` reports) for the engine's state keys.
ENGINE_PARTS = {"optimizer": "optimizer", "schedule": "scheduler", "precision": "scaler",
                "counters": "counters"}


def checkpoint_parts(run: Run, next_window: int, ledger: Ledger | None) -> dict[str, Any]:
    """Everything S2 asks for besides the weights, one named part each."""
    update_state = run.engine.state_dict()
    return {
        **{ENGINE_PARTS[k]: v for k, v in update_state.items()},
        "progress": {
            "next_window": next_window,
            "ledger_position": ledger.position if ledger is not None else 0,
            "manifest_digest": run.manifest.digest,
        },
        "rng": capture_rng(),
        "data": run.stream.state_dict(),
    }


def save_checkpoint(run: Run, next_window: int, ledger: Ledger | None) -> Path:
    """Publish S2 state atomically (S3); multi-rank jobs go through DCP (S7)."""
    name = f"window-{next_window:08d}"
    parts = checkpoint_parts(run, next_window, ledger)
    if run.ctx.distributed:
        rank_state = {"rng": parts.pop("rng"), "data": parts.pop("data")}
        parts.pop("optimizer", None)
        return save_distributed_checkpoint(
            run.checkpoints, name, model=run.model, optimizer=run.engine.optimizer,
            common=parts, rank_state=rank_state, ctx=run.ctx, keep=run.cfg.checkpoint.keep,
        )
    model_state = {k: v.detach().cpu() for k, v in run.model.state_dict().items()}
    return publish_checkpoint(run.checkpoints, name, model_state, parts,
                              keep=run.cfg.checkpoint.keep)


def restore_checkpoint(run: Run, path: Path, *, weights_only: bool = False,
                       reshard: bool = False) -> tuple[int, int]:
    """Load a committed checkpoint into ``run``; returns (next window, ledger position).

    The checkpoint's own format decides the loader (S7): a multi-rank checkpoint
    loads through DCP even into one process, and a one-process checkpoint into
    several ranks; either migration needs ``reshard`` (checked by the loaders).
    """
    if is_distributed_checkpoint(path):
        return restore_distributed(run, path, reshard=reshard, weights_only=weights_only)
    if run.ctx.world_size != 1 and not (reshard or weights_only):
        raise DistributedError(
            f"checkpoint {path.name} was written by 1 process but this job has "
            f"{run.ctx.world_size}; relaunch with 1 process, or pass --reshard"
        )
    model_state, parts = load_checkpoint(path)
    run.model.load_state_dict(model_state)
    if weights_only:
        return 0, 0
    progress = parts["progress"]
    check_progress_digest(progress, run.manifest, path)
    run.engine.load_state_dict({k: parts[name] for k, name in ENGINE_PARTS.items()})
    restore_rng(parts["rng"])
    if run.ctx.world_size == 1:
        run.stream.load_state_dict(parts["data"])
    else:
        run.stream.load_state_dict(reshard_stream_state([parts["data"]], run.stream.state_dict()))
        run.events.append(reshard_record(1, run.ctx.world_size, [parts["data"]]))
    return int(progress["next_window"]), int(progress["ledger_position"])


def restore_distributed(run: Run, path: Path, *, reshard: bool,
                        weights_only: bool = False) -> tuple[int, int]:
    """S7: every rank loads its shard; a world-size change only with ``reshard``."""
    state = load_distributed_checkpoint(path, model=run.model, optimizer=run.engine.optimizer,
                                        ctx=run.ctx, reshard=reshard or weights_only)
    if weights_only:
        return 0, 0
    common = state.common
    progress = common["progress"]
    check_progress_digest(progress, run.manifest, path)
    engine_state = {k: common[name] for k, name in ENGINE_PARTS.items() if name != "optimizer"}
    engine_state["optimizer"] = run.engine.optimizer.state_dict()  # loaded by DCP above
    run.engine.load_state_dict(engine_state)
    if state.reshard is None:
        run.stream.load_state_dict(state.rank_state["data"])
    else:
        run.stream.load_state_dict(reshard_stream_state(state.old_data, run.stream.state_dict()))
        run.events.append(state.reshard)
    restore_rng(state.rank_state["rng"])
    return int(progress["next_window"]), int(progress["ledger_position"])


# --------------------------------------------------------------------------- loop


@dataclass
class Meter:
    """Interval accumulator for progress and metrics (values already on the host)."""

    started: float = field(default_factory=time.perf_counter)
    interval_start: float = field(default_factory=time.perf_counter)
    nll: float = 0.0
    denom: float = 0.0
    tokens: int = 0
    slots: int = 0
    total_slots: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})

    def add(self, disp: Disposition, slots: int) -> None:
        self.counts[disp.outcome.value] += 1
        self.slots += slots
        self.total_slots += slots
        if disp.outcome is Outcome.COMMITTED and disp.loss is not None:
            self.nll += disp.loss * disp.denominator
            self.denom += disp.denominator
            self.tokens += disp.tokens

    def flush(self, window: int, lr: float | None) -> dict[str, Any]:
        now = time.perf_counter()
        elapsed = max(now - self.interval_start, 1e-9)
        record = {
            "window": window,
            "loss": self.nll / self.denom if self.denom else None,
            "lr": lr,
            "tokens_per_s": self.slots / elapsed,
            "supervised_tokens": self.tokens,
            "elapsed_s": now - self.started,
            **{k.lower(): v for k, v in self.counts.items()},
        }
        self.interval_start, self.nll, self.denom, self.tokens, self.slots = now, 0.0, 0.0, 0, 0
        return record


def run_windows(run: Run, start: int, ledger: Ledger | None, progress: bool) -> None:
    """Drive windows ``start .. train.steps-1``; checkpoint on cadence and on signals."""
    cfg, main = run.cfg, run.ctx.is_main
    steps, every = cfg.train.steps, cfg.checkpoint.every
    metrics_path = run.out_dir / "metrics.jsonl"
    meter = Meter()
    bar = make_bar(steps, start, enabled=progress and cfg.train.progress and main)
    it = iter(run.stream)
    reducer = run.engine.reducer if run.ctx.distributed else None
    window = start
    with (
        StopRequest() as stop,
        metrics_path.open("a") if main else open(os.devnull, "w") as metrics,
        collective_guard(run.ctx),
    ):
        while window < steps:
            # Up to K microbatches; fewer only at the end of the data (U1 remainder);
            # every rank runs the same count (D1).
            batches = agreed_window(it, cfg.update.accum, reducer, rows=cfg.batch.rows,
                                    seq_len=cfg.batch.seq_len, pad_id=run.tokenizer.pad_id)
            if not batches:
                break
            disp = run.engine.run_window(batches, window)
            meter.add(disp, sum(b.input_ids.numel() for b in batches))
            window += 1
            if ledger is not None:
                ledger.append(disp)
            if main and (window % cfg.train.log_every == 0 or window == steps):
                record = meter.flush(window, run.engine.schedule.lr())
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                update_bar(bar, record, run.engine)
            if cfg.train.eval_every and window % cfg.train.eval_every == 0 and window < steps:
                record = eval_record(run)
                if main:
                    metrics.write(json.dumps({"window": window, **record}) + "\n")
            if every and window % every == 0 and window < steps:
                save_checkpoint(run, window, ledger)
            if stop.requested:
                save_checkpoint(run, window, ledger)
                bar.close()
                raise Interrupted(
                    f"stopped by {stop.signal_name} after window {window}; a checkpoint was "
                    f"published; continue with: exactstep resume {run.out_dir}"
                )
    bar.close()
    save_checkpoint(run, window, ledger)


def make_bar(total: int, start: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="win",
                dynamic_ncols=True, file=sys.stderr)


def update_bar(bar, record: dict, engine: UpdateEngine) -> None:
    loss = record["loss"]
    bar.set_postfix(
        loss=f"{loss:.3f}" if loss is not None else "n/a",
        lr=f"{record['lr']:.2e}" if record["lr"] is not None else "n/a",
        tok_s=f"{record['tokens_per_s']:.0f}",
        ok=engine.committed, skip=engine.skipped, noobj=engine.no_objective,
        refresh=False,
    )
    bar.n = record["window"]
    bar.refresh()


# --------------------------------------------------------------------------- eval


def held_out(run: Run) -> EvalResult:
    batches = eval_batches(run.data.val, run.cfg.batch, pad_id=run.tokenizer.pad_id,
                           vocab_size=run.tokenizer.vocab_size)
    return evaluate(run.model, batches, device=run.device, max_tokens=run.cfg.train.eval_tokens,
                    pad_id=run.tokenizer.pad_id, autocast=run.precision.autocast)


def eval_record(run: Run) -> dict[str, Any]:
    result = held_out(run)
    ppl = result.perplexity
    return {
        "eval_loss": result.loss,
        "eval_tokens": result.tokens,
        "eval_bits_per_byte": result.bits_per_token,
        "eval_perplexity": ppl if not isinstance(ppl, NotAvailable) else f"N/A ({ppl.cause})",
    }


def baseline_bits(run: Run) -> float | None:
    """Unigram (byte-frequency) bits per byte on the same validation targets."""
    val = eval_batches(run.data.val, run.cfg.batch, pad_id=run.tokenizer.pad_id)
    return unigram_bits(run.data.train, val, run.tokenizer.vocab_size, run.cfg.train.eval_tokens)


# --------------------------------------------------------------------------- outputs


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def plot_loss(run_dir: Path) -> None:
    """``loss.png``: committed window losses, a moving average, and evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, losses, evals = [], [], []
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("disposition") == "COMMITTED" and isinstance(rec["loss"], float):
            windows.append(rec["window"])
            losses.append(rec["loss"])
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if isinstance(rec.get("eval_loss"), float):
                evals.append((rec["window"], rec["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(windows, losses, lw=0.6, alpha=0.5, label="train (window S/D)")
    if len(losses) >= 10:
        k = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1])
                  for i in range(len(losses))]
        ax.plot(windows, smooth, lw=1.5, label=f"train, mean of {k + 1}")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out")
    ax.set_xlabel("window")
    ax.set_ylabel("loss (nats / target)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)


def summarize(run: Run, wall_s: float) -> dict[str, Any]:
    """End-of-run figures: held-out loss/perplexity/bits per byte against the unigram
    baseline on the same targets, window counters, and the data report (R4)."""
    result = held_out(run)
    unigram = baseline_bits(run)
    bpb = result.bits_per_token
    ppl = result.perplexity
    summary = {
        "windows": {
            "committed": run.engine.committed,
            "skipped_nonfinite": run.engine.skipped,
            "no_objective": run.engine.no_objective,
        },
        "supervised_tokens": run.engine.tokens,
        "wall_s": wall_s,
        "heldout_loss": result.loss,
        "heldout_tokens": result.tokens,
        "heldout_perplexity": ppl if not isinstance(ppl, NotAvailable) else f"N/A ({ppl.cause})",
        "heldout_bits_per_byte": bpb,
        "unigram_bits_per_byte": unigram,
        "bpb_ratio_to_unigram": (bpb / unigram) if (bpb and unigram) else None,
        "data": run.stream.report(),
        "manifest_digest": run.manifest.digest,
    }
    return summary


def format_summary(s: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".4f") -> str:
        return format(x, spec) if isinstance(x, float) else str(x)

    w = s["windows"]
    data = s["data"]
    lines = [
        "",
        "run summary",
        f"  windows             {w['committed']} committed, {w['skipped_nonfinite']} skipped "
        f"(non-finite), {w['no_objective']} no objective",
        f"  supervised tokens   {s['supervised_tokens']}",
        f"  wall time           {s['wall_s']:.1f} s",
        f"  held-out loss       {f(s['heldout_loss'])} nats/token over {s['heldout_tokens']} targets",
        f"  held-out perplexity {f(s['heldout_perplexity'], '.3f')}",
        f"  bits per byte       {f(s['heldout_bits_per_byte'])}",
        f"  unigram baseline    {f(s['unigram_bits_per_byte'])} bits per byte",
        f"  ratio to unigram    {f(s['bpb_ratio_to_unigram'], '.3f')}",
        f"  packing efficiency  {f(data.get('efficiency'), '.4f')}",
    ]
    for key in ("split_documents", "truncated_documents", "dropped_documents", "dropped_targets"):
        if key in data:
            lines.append(f"  {key.replace('_', ' '):<19} {data[key]}")
    if "exact_match" in s:
        lines.append(f"  exact match         {f(s['exact_match'], '.3f')} "
                     f"on {s['exact_match_n']} held-out conversations")
    return "\n".join(lines)


def finish(run: Run, started: float) -> dict[str, Any]:
    """Evaluate, then (rank 0) write the summary, data report and loss curve."""
    summary = summarize(run, time.perf_counter() - started)
    if run.data.heldout_conversations is not None:
        from exactstep.rows.chat_source import heldout_accuracy

        summary.update(heldout_accuracy(run))
    if not run.ctx.is_main:
        return summary
    write_json(run.out_dir / "data_report.json", run.stream.report())
    write_json(run.out_dir / "summary.json", summary)
    plot_loss(run.out_dir)
    print(format_summary(summary), flush=True)
    return summary


# --------------------------------------------------------------------------- entry points


def train(cfg: RunConfig, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """A new run in ``out_dir``. Refuses a directory that already holds another run."""
    started = time.perf_counter()
    run = build_run(cfg, out_dir)
    try:
        ledger = open_new_run(run)
        if run.ctx.is_main:
            print(f"exactstep: {run.model.num_parameters():,} parameters on {run.device} "
                  f"x {run.ctx.world_size}, {len(run.data.train)} train / {len(run.data.val)} "
                  f"val documents, manifest {run.manifest.digest[:12]}, run dir {out_dir}",
                  file=sys.stderr)
        run_windows(run, 0, ledger, progress)
        return finish(run, started)
    finally:
        shutdown(run.ctx)


def open_new_run(run: Run) -> Ledger | None:
    """Write the immutable manifest (S1) and empty logs; the ledger lives on rank 0."""
    out_dir = run.out_dir
    if not run.ctx.is_main:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    ledger_path = out_dir / "ledger.jsonl"
    if ledger_path.exists() and ledger_path.stat().st_size:
        raise ResumeError(
            f"{out_dir} already holds a run; use 'exactstep resume {out_dir}' or choose a new --out"
        )
    write_manifest(out_dir, run.manifest)
    (out_dir / "metrics.jsonl").write_text("")
    return Ledger(ledger_path)


def config_from_manifest(manifest: Manifest) -> RunConfig:
    return build(RunConfig, manifest.body["config"], prefix="")


def apply_overrides(cfg: RunConfig, overrides: Sequence[str]) -> RunConfig:
    if not overrides:
        return cfg
    raw = cfg.to_dict()
    for item in overrides:
        key, value = split_override(item)
        set_dotted(raw, key, value)
    return build(RunConfig, raw, prefix="")


def resume(
    run_dir: Path,
    *,
    from_checkpoint: Path | None = None,
    overrides: Sequence[str] = (),
    warm_start_dir: Path | None = None,
    reshard: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Continue ``run_dir`` exactly (S4), or warm-start a new run from its weights.

    A different world size is a declared migration (S7): refused unless ``reshard``,
    which keeps the run's manifest, re-partitions the data cursor by the rule in
    ``parallel.checkpoint`` and records a RESHARD line in the ledger.
    """
    started = time.perf_counter()
    old = read_manifest(run_dir)
    cfg = apply_overrides(config_from_manifest(old), overrides)
    root = run_dir / "checkpoints"
    if warm_start_dir is not None:
        path = choose_checkpoint(root, from_checkpoint)
        parent = {"run_dir": str(run_dir), "checkpoint": path.name, "manifest_digest": old.digest}
        run = build_run(cfg, warm_start_dir, parent=parent)
        if run.ctx.distributed:
            shutdown(run.ctx)
            raise DistributedError("--warm-start runs in one process; launch it without torchrun")
        restore_checkpoint(run, path, weights_only=True)
        ledger = open_new_run(run)
        run_windows(run, 0, ledger, progress)
        return finish(run, started)
    run = build_run(cfg, run_dir)
    try:
        if run.ctx.is_main and root.is_dir():
            clean_uncommitted(root)
        path = choose_checkpoint(root, from_checkpoint)
        changed = diff_manifests(old, run.manifest)
        if reshard and set(changed) <= {"parallel.world_size"}:
            run.manifest = old
        classify_resume(old, run.manifest)
        next_window, ledger_position = restore_checkpoint(run, path, reshard=reshard)
        ledger = None
        if run.ctx.is_main:
            ledger = Ledger(run_dir / "ledger.jsonl")
            ledger.truncate_to(ledger_position)
            for event in run.events:
                ledger.append(event)
            truncate_metrics(run_dir / "metrics.jsonl", next_window)
            print(f"exactstep: resuming {run_dir} at window {next_window} from {path.name}",
                  file=sys.stderr)
        run_windows(run, next_window, ledger, progress)
        return finish(run, started)
    finally:
        shutdown(run.ctx)


def truncate_metrics(path: Path, next_window: int) -> None:
    """Drop metric lines written after the checkpoint being resumed (they will recur)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if json.loads(line).get("window", 0) <= next_window]
    path.write_text("".join(line + "\n" for line in keep))


@dataclass(frozen=True)
class EvalReport:
    checkpoint: str
    result: EvalResult
    unigram: float | None

    def format(self) -> str:
        r = self.result
        ppl = r.perplexity
        ppl_s = f"N/A ({ppl.cause})" if isinstance(ppl, NotAvailable) else f"{ppl:.3f}"
        loss_s = f"{r.loss:.4f}" if r.loss is not None else "N/A (no targets)"
        bpb = f"{r.bits_per_token:.4f}" if r.bits_per_token is not None else "N/A"
        uni = f"{self.unigram:.4f}" if self.unigram is not None else "N/A"
        return (f"checkpoint {self.checkpoint}\n  held-out loss {loss_s} over {r.tokens} targets\n"
                f"  perplexity {ppl_s}\n  bits per byte {bpb} (unigram baseline {uni})")


def evaluate_run(run_dir: Path, *, from_checkpoint: Path | None = None) -> EvalReport:
    """Evaluate a run's checkpoint on its validation split (E1, L5)."""
    cfg = config_from_manifest(read_manifest(run_dir))
    path = choose_checkpoint(run_dir / "checkpoints", from_checkpoint)
    run = build_run(cfg, run_dir)
    restore_checkpoint(run, path, weights_only=True)
    return EvalReport(path.name, held_out(run), baseline_bits(run))


def inspect_rows(cfg: RunConfig, rows: range, *, split: str = "train") -> str:
    """Render rows of the first microbatch the run would see (R6)."""
    from exactstep.rows.inspect import render_rows

    tokenizer = ByteTokenizer()
    data = build_data(cfg, tokenizer)
    examples = data.train if split == "train" else data.val
    if split == "train":
        batch = next(iter(RowStream(examples, cfg.batch, pad_id=tokenizer.pad_id, seed=cfg.seed)))
    else:
        batch = next(iter(eval_batches(examples, cfg.batch, pad_id=tokenizer.pad_id)))
    if rows.stop > batch.input_ids.shape[0]:
        raise ConfigError(f"--rows {rows.start}:{rows.stop} is outside the microbatch's "
                          f"{batch.input_ids.shape[0]} rows")
    return render_rows(batch, tokenizer, rows)


__all__ = ["train", "resume", "evaluate_run", "inspect_rows", "load_config"]
