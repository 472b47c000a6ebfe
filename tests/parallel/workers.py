"""Helpers shared by the multi-process tests: tiny runs, hand-made shards, spawned ranks.

Each rank runs in its own spawned process over gloo on localhost. A rank writes what
the test checks (parameters, ledger records, its error message) to a file in a
directory the test owns; the parent joins every process with a hard deadline and
kills what is left, so no test can hang.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from exactstep.errors import ExactstepError
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.launch import collective_guard
from exactstep.parallel.process_group import free_port, init_distributed, launcher_env, shutdown
from exactstep.parallel.reducer import DDPReducer
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB = 32
PAD_ID = 0
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, attention="dense")
UPDATE = UpdateConfig(accum=2, optimizer="adamw", lr=1e-2, warmup=0, schedule="constant",
                      clip=1.0, weight_decay=0.1)
OBJECTIVE = ObjectiveConfig()


# ----------------------------------------------------------------- hand-made shards


def make_batch(seed: int, rows: int, seq_len: int, supervised: int) -> Batch:
    """``rows`` x ``seq_len`` random tokens, one document per row, ``supervised``
    targets in total (0 = an empty microbatch), spread over the first rows."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, VOCAB, (rows, seq_len), generator=g)  # [B, T]
    targets = torch.randint(1, VOCAB, (rows, seq_len), generator=g)  # [B, T]
    labels = torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.int64)
    flat = labels.view(-1)
    flat[:supervised] = targets.view(-1)[:supervised]
    positions = torch.arange(seq_len).expand(rows, seq_len).clone()
    segment_ids = torch.ones((rows, seq_len), dtype=torch.int32)
    segments = tuple((Segment(seed * 100 + r, 0, 0, 0, seq_len),) for r in range(rows))
    return Batch(input_ids, labels, positions, segment_ids, segments)


def shards(token_counts: Sequence[Sequence[Sequence[int]]], *, rows: int = 2,
           seq_len: int = 8) -> list[list[list[Batch]]]:
    """``token_counts[rank][window][microbatch]`` -> the same nesting of batches."""
    return [
        [
            [make_batch(1000 * r + 10 * w + m, rows, seq_len, n) for m, n in enumerate(window)]
            for w, window in enumerate(windows)
        ]
        for r, windows in enumerate(token_counts)
    ]


# ----------------------------------------------------------------- one rank's run


def build_engine(update: UpdateConfig = UPDATE, reducer=None, seed: int = 0) -> UpdateEngine:
    from exactstep.update.groups import build_optimizer

    model = build_model(MODEL, VOCAB, seed=seed)
    optimizer, _ = build_optimizer(model, update)
    schedule = build_schedule(update, total_windows=100)
    precision = Precision(NumericsConfig(), "cpu")
    return UpdateEngine(model, optimizer, schedule, precision, update, OBJECTIVE,
                        device=torch.device("cpu"), pad_id=PAD_ID, reducer=reducer)


def run_windows(engine: UpdateEngine, windows: Sequence[Sequence[Batch]]) -> list[dict]:
    return [engine.run_window(list(batches), w).ledger_record()
            for w, batches in enumerate(windows)]


def params_of(engine: UpdateEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


class RankLocalMeanReducer(DDPReducer):
    """Deliberately wrong (negative control for D5): each rank divides by its *own*
    denominator, so DDP's average gives the mean of rank-local means."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if values.dtype == torch.float64:  # the window's [D, tokens]: not shared
            return values * self.world_size
        return super().sum(values)


class UnagreedFiniteReducer(DDPReducer):
    """Deliberately wrong (negative control for D2): the finite flag stays local."""

    def agree(self, values: torch.Tensor) -> torch.Tensor:  # [bad flag, numerator, gold NLL]
        return values.clone()


def reducers() -> dict[str, type]:
    return {"ddp": DDPReducer, "local_mean": RankLocalMeanReducer,
            "unagreed_finite": UnagreedFiniteReducer,
            "sync_every_microbatch": SyncEveryMicrobatchReducer}


def rank_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: join, run each of ``job['phases']`` with a fresh engine, write what the
    test checks (params + ledger per phase), or the error that stopped it."""
    if job.get("host_group_without_timeout"):  # negative control: the 30-minute default
        import torch.distributed as dist

        from exactstep.parallel import process_group

        process_group.new_host_group = lambda timeout: dist.new_group(backend="gloo")
    cfg = ParallelConfig(timeout_s=job.get("timeout_s", 30.0))
    run_phases(rank, world, port, out, cfg, job["phases"],
               lambda ctx, phase: run_phase(rank, ctx, cfg, phase))


def run_phases(rank: int, world: int, port: int, out: str, cfg: ParallelConfig,
               phases: Sequence[dict], run_one: Callable[[object, dict], dict]) -> None:
    """Join the gloo job under ``cfg``, ``run_one(ctx, phase)`` for each phase, and write
    ``{"phases": [...], "ended": t}`` (or, with the phases done, the error that stopped
    it: its type, message and, when not exactstep's, traceback) to ``out/rank<r>.pt``."""
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    ctx = None
    results: list[dict] = []
    try:
        ctx = init_distributed(cfg, "cpu", env=launcher_env(rank, world, port))
        with collective_guard(ctx):
            for phase in phases:
                results.append(run_one(ctx, phase))
        torch.save({"phases": results, "ended": time.time()}, path)
    except ExactstepError as exc:
        torch.save({"phases": results, "error": str(exc), "kind": type(exc).__name__,
                    "ended": time.time()}, path)
    except BaseException as exc:  # noqa: BLE001 - the test reads what failed
        torch.save({"phases": results, "kind": type(exc).__name__,
                    "error": "".join(traceback.format_exception_only(exc)).strip(),
                    "traceback": traceback.format_exc()}, path)
    finally:
        if ctx is not None:
            try:
                shutdown(ctx)
            except Exception:  # noqa: BLE001 - a dead peer may already have broken the group
                pass


def run_phase(rank: int, ctx, cfg: ParallelConfig, phase: dict) -> dict:
    update = replace(UPDATE, fail_window=phase.get("fail_window", {}).get(rank, -1))
    engine = build_engine(update)
    distribute_engine(engine, ctx, cfg)
    engine.reducer = reducers()[phase.get("reducer", "ddp")](ctx)
    if phase.get("count_ddp_collectives"):
        calls = count_ddp_collectives(engine, phase["windows"][rank])
        return {"params": params_of(engine), "ddp_calls": calls,
                "grad_bytes": sum(p.numel() * p.element_size() for p in engine.parameters)}
    records = []
    for w, batches in enumerate(phase["windows"][rank]):
        if phase.get("kill_at") == (rank, w):
            os.kill(os.getpid(), signal.SIGKILL)
        if "out" in phase:
            (Path(phase["out"]) / f"started{rank}-{w}").write_text(str(time.time()))
        if phase.get("stall_at") == (rank, w):
            stall(Path(phase["out"]), w, phase["stall_s"])
        records.append(engine.run_window(list(batches), w).ledger_record())
    return {"params": params_of(engine), "ledger": records,
            "collectives": engine.reducer.collectives}


def stall(out: Path, window: int, seconds: float) -> None:
    """Alive but silent in ``window`` (a peer that stalls, not one that dies): wait
    until rank 0 has started the window, then until rank 0 has reported (its result
    file exists) or ``seconds`` have passed since it started; then go on. Measured
    from rank 0's start, the stall cannot end early on a loaded machine."""
    deadline = time.time() + 60
    started = out / f"started0-{window}"
    while not started.exists() and time.time() < deadline:
        time.sleep(0.02)
    until = float(started.read_text() or time.time()) + seconds
    while not (out / "rank0.pt").exists() and time.time() < until:
        time.sleep(0.02)


def spawn_ranks(target: Callable, world: int, out: Path, job: dict, *,
                deadline_s: float) -> tuple[list[dict | None], list[int | None], float]:
    """Start ``world`` spawned ranks, join all by ``deadline_s``, kill stragglers.

    Returns each rank's saved result (None if it wrote none), exit codes (None if it
    had to be killed) and the seconds until the last rank ended.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(out), job), daemon=True)
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    codes: list[int | None] = []
    for p in procs:
        p.join(max(0.0, deadline_s - (time.monotonic() - start)))
        codes.append(p.exitcode)
    elapsed = time.monotonic() - start
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    results = []
    for r in range(world):
        f = out / f"rank{r}.pt"
        results.append(torch.load(f, weights_only=False) if f.exists() else None)
    return results, codes, elapsed


def ledger_json(records: list[dict]) -> str:
    return json.dumps(records, sort_keys=True)


# ----------------------------------------------------------------- real data, checkpoints


def tiny_examples(n: int = 24, seed: int = 0) -> list:
    """``n`` documents of 3..20 random tokens (ids in [1, VOCAB))."""
    import numpy as np

    from exactstep.rows.example import Example

    rng = np.random.default_rng(seed)
    return [Example(i, rng.integers(1, VOCAB, size=int(rng.integers(3, 21))).astype(np.int64))
            for i in range(n)]


def batch_cfg():
    from exactstep.rows.config import BatchConfig

    return BatchConfig(seq_len=16, rows=2, buffer=8)


def stream_for(rank: int, world: int):
    from exactstep.rows.stream import RowStream

    return RowStream(tiny_examples(), batch_cfg(), pad_id=PAD_ID, seed=3, rank=rank,
                     world=world, vocab_size=VOCAB)


def train_windows(engine, stream, first: int, count: int, reducer) -> list[dict]:
    from exactstep.parallel.agreement import agreed_window

    it = iter(stream)
    cfg = batch_cfg()
    records = []
    for w in range(first, first + count):
        batches = agreed_window(it, 2, reducer, rows=cfg.rows, seq_len=cfg.seq_len,
                                pad_id=PAD_ID)
        records.append(engine.run_window(batches, w).ledger_record())
    return records


def common_state(engine) -> dict:
    return {"schedule": engine.schedule.state_dict(), "precision": engine.precision.state_dict(),
            "counters": engine.counters()}


def load_common(engine, common: dict) -> None:
    engine.schedule.load_state_dict(common["schedule"])
    engine.precision.load_state_dict(common["precision"])
    for name, value in common["counters"].items():
        setattr(engine, name, int(value))


def ckpt_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """Straight: 2 windows, checkpoint, 2 windows. Resumed: load, 2 windows. Control:
    weights only (fresh optimizer), 2 windows. Writes params, ledgers and RNG draws."""
    from exactstep.parallel.dcp_format import (
        load_distributed_checkpoint,
        save_distributed_checkpoint,
    )
    from exactstep.state.rng import capture_rng, restore_rng

    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    cfg = ParallelConfig(timeout_s=30.0)
    ctx = init_distributed(cfg, "cpu", env=launcher_env(rank, world, port))
    root = Path(out) / "checkpoints"
    result: dict = {}
    try:
        with collective_guard(ctx):
            engine, stream = distribute_engine(build_engine(), ctx, cfg), stream_for(rank, world)
            torch.manual_seed(100 + rank)
            first = train_windows(engine, stream, 0, 2, engine.reducer)
            save_distributed_checkpoint(
                root, "window-00000002", model=engine.model, optimizer=engine.optimizer,
                common=common_state(engine), rank_state={"rng": capture_rng(),
                                                         "data": stream.state_dict()},
                ctx=ctx, keep=2)
            draw = torch.rand(3)
            straight = train_windows(engine, stream, 2, 2, engine.reducer)
            result["straight"] = {"params": params_of(engine), "ledger": first + straight,
                                  "draw": draw}

            engine, stream = distribute_engine(build_engine(seed=7), ctx, cfg), stream_for(rank, world)
            state = load_distributed_checkpoint(root / "window-00000002", model=engine.model,
                                                optimizer=engine.optimizer, ctx=ctx)
            load_common(engine, state.common)
            restore_rng(state.rank_state["rng"])
            stream.load_state_dict(state.rank_state["data"])
            draw = torch.rand(3)
            resumed = train_windows(engine, stream, 2, 2, engine.reducer)
            result["resumed"] = {"params": params_of(engine), "ledger": first + resumed,
                                 "draw": draw}

            control, stream = distribute_engine(build_engine(seed=7), ctx, cfg), stream_for(rank, world)
            import torch.distributed.checkpoint as dcp
            model_sd = {k: v for k, v in control.model.state_dict().items()}
            dcp.load({"model": model_sd}, checkpoint_id=str(root / "window-00000002" / "dcp"))
            control.model.load_state_dict(model_sd)
            stream.load_state_dict(state.rank_state["data"])
            load_common(control, state.common)
            train_windows(control, stream, 2, 2, control.reducer)
            result["control"] = {"params": params_of(control)}
        torch.save(result, path)
    except BaseException as exc:  # noqa: BLE001 - the test reads what failed
        torch.save({**result, "error": str(exc), "traceback": traceback.format_exc()}, path)
    finally:
        shutdown(ctx)


# ----------------------------------------------------------------- FSDP2 and host reads


class LocalShardNormEngine(UpdateEngine):
    """Deliberately wrong (negative control for D4): the clipping norm is taken over
    this rank's gradient shards only, never reduced across ranks."""

    def _grad_norm(self) -> torch.Tensor:
        from torch.nn.utils import get_total_norm

        grads = [g.to_local() if hasattr(g, "to_local") else g for g in self._grads()]
        return get_total_norm(grads, 2.0).float()


def build_rank_engine(ctx, cfg: ParallelConfig, update: UpdateConfig,
                      engine_cls=UpdateEngine, precision: str = "fp32") -> UpdateEngine:
    """``build_engine`` for one rank: FSDP2 shards the model before the optimizer is
    built (``parallel.strategy = "fsdp"``), DDP wraps the train module (``"ddp"``)."""
    from exactstep.parallel.wrap import shard_model
    from exactstep.update.groups import build_optimizer

    model = shard_model(build_model(MODEL, VOCAB, seed=0), ctx, cfg, precision=precision)
    optimizer, _ = build_optimizer(model, update)
    schedule = build_schedule(update, total_windows=100)
    precision = Precision(NumericsConfig(precision=precision), "cpu")
    engine = engine_cls(model, optimizer, schedule, precision, update, OBJECTIVE,
                        device=torch.device("cpu"), pad_id=PAD_ID)
    return distribute_engine(engine, ctx, cfg)


def full_params(engine: UpdateEngine) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (FSDP2 holds DTensor shards)."""
    out = {}
    for name, value in engine.model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().clone()
    return out


def run_rank(rank: int, world: int, port: int, out: str, cfg: ParallelConfig,
             body: Callable[[object, dict], None]) -> None:
    """One spawned rank: join the gloo group under ``cfg``, run ``body(ctx, result)``
    under the collective guard, and write ``result`` (or, with what was filled in
    before, the error, its type and traceback) to ``out/rank{rank}.pt``."""
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    ctx = None
    result: dict = {}
    try:
        ctx = init_distributed(cfg, "cpu", env=launcher_env(rank, world, port))
        with collective_guard(ctx):
            body(ctx, result)
        torch.save(result, path)
    except BaseException as exc:  # noqa: BLE001 - the test reads what failed
        torch.save({**result, "kind": type(exc).__name__, "error": str(exc),
                    "traceback": traceback.format_exc()}, path)
    finally:
        if ctx is not None:
            try:
                shutdown(ctx)
            except Exception:  # noqa: BLE001
                pass


def fsdp_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """FSDP2 over gloo: run ``job['windows'][rank]`` with the right engine and with the
    local-shard-norm engine; write gathered parameters and ledgers (or the error)."""
    cfg = ParallelConfig(strategy="fsdp", timeout_s=30.0)

    def body(ctx, result: dict) -> None:
        update = replace(UPDATE, clip=job["clip"])
        runs = [("right", UpdateEngine, "fp32"), ("local_norm", LocalShardNormEngine, "fp32"),
                ("bf16", UpdateEngine, "bf16")]
        for name, cls, precision in runs:
            engine = build_rank_engine(ctx, cfg, update, cls, precision)
            dtypes: set[str] = set()  # what a block's weight is while it runs
            engine.model.layers[0].attn.qkv.register_forward_pre_hook(
                lambda module, args, seen=dtypes: seen.add(str(module.weight.dtype)))
            ledger = run_windows(engine, job["windows"][rank])
            result[name] = {"params": full_params(engine), "ledger": ledger,
                            "forward_dtypes": sorted(dtypes)}

    run_rank(rank, world, port, out, cfg, body)


SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


class HostReadCounter:
    """Counts reads of tensor values into Python while the window runs (U7).

    Exempt, because they never involve a device: the host-side batches, the
    objective's host-side plan, and *host-born* tensors: made by ``torch.tensor``
    from Python values on the host, and the results of the reducer's collectives
    over such tensors (a host all-reduce is a collective, not a device sync).
    Everything else (values computed by the forward/backward) counts.
    """

    def __init__(self) -> None:
        self.count = 0
        self.paused = 0
        self.host_born: dict[int, object] = {}  # id -> weak reference (ids are reused)
        self.undo: list = []

    def mark(self, t: torch.Tensor) -> None:
        import weakref

        self.host_born[id(t)] = weakref.ref(t)

    def is_host_born(self, t: torch.Tensor) -> bool:
        ref = self.host_born.get(id(t))
        return ref is not None and ref() is t

    def install(self) -> None:
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self.undo.append((torch.Tensor, name, original))
            setattr(torch.Tensor, name, self._counted(original))
        factory = torch.tensor
        self.undo.append((torch, "tensor", factory))

        def tensor(*args, **kwargs):
            made = factory(*args, **kwargs)
            if made.device.type == "cpu":
                self.mark(made)
            return made

        torch.tensor = tensor

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)

    def _counted(self, original):
        def counted(t, *args, **kwargs):
            if not self.paused and not self.is_host_born(t):
                self.count += 1
            return original(t, *args, **kwargs)

        return counted

    def watch(self, engine: UpdateEngine, batches: Sequence[Batch]) -> None:
        for b in batches:
            for t in (b.input_ids, b.labels, b.position_ids, b.segment_ids):
                self.mark(t)
        if not getattr(engine, "_counted", False):
            plan, reducer_sum = engine.plan, engine.reducer.sum

            def paused_plan(*args, **kwargs):
                self.paused += 1
                try:
                    return plan(*args, **kwargs)
                finally:
                    self.paused -= 1

            def host_sum(values):
                out = reducer_sum(values)
                if self.is_host_born(values):
                    self.mark(out)
                return out

            engine.plan, engine.reducer.sum, engine._counted = paused_plan, host_sum, True


class NormLoggingEngine(UpdateEngine):
    """Deliberately wrong (negative control for U7): reads the norm on its own."""

    def _grad_norm(self) -> torch.Tensor:
        norm = super()._grad_norm()
        self.logged_norm = norm.item()  # WRONG: a second device read per window
        return norm


def sync_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """Count device reads per window: DDP, FSDP2 and the norm-logging control."""
    counter = HostReadCounter()

    def body(ctx, result: dict) -> None:
        for name, strategy, cls in (("ddp", "ddp", UpdateEngine),
                                    ("fsdp", "fsdp", UpdateEngine),
                                    ("control", "ddp", NormLoggingEngine)):
            cfg = ParallelConfig(strategy=strategy, timeout_s=30.0)
            engine = build_rank_engine(ctx, cfg, UPDATE, cls)
            counts = []
            counter.install()
            try:
                for w, batches in enumerate(job["windows"][rank]):
                    counter.watch(engine, batches)
                    counter.count = 0
                    engine.run_window(list(batches), w)
                    counts.append(counter.count)
            finally:
                counter.uninstall()
            result[name] = counts

    run_rank(rank, world, port, out, ParallelConfig(timeout_s=30.0), body)


# ----------------------------------------------------------------- DDP communication cadence


class SyncEveryMicrobatchReducer(DDPReducer):
    """Deliberately wrong (negative control for D1's cadence): never enters ``no_sync``,
    so DDP all-reduces the gradient buckets after every microbatch's backward."""

    def no_sync(self, module, is_last: bool):
        import contextlib

        return contextlib.nullcontext()


def count_ddp_collectives(engine: UpdateEngine, windows: Sequence[Sequence[Batch]]) -> list[dict]:
    """Run ``windows`` and record every gradient-bucket all-reduce DDP itself issues.

    A communication hook on the DDP-wrapped train module sees each bucket DDP
    reduces (it then does DDP's default averaging all-reduce); a forward pre-hook
    numbers the microbatches, so each call is recorded as (window, microbatch, bucket).
    """
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    ddp = engine.train_module
    assert isinstance(ddp, DistributedDataParallel), type(ddp)
    where = {"window": -1, "microbatch": -1}
    calls: list[dict] = []

    def counting_hook(state, bucket):
        calls.append({**where, "bucket": bucket.index()})
        return allreduce_hook(dist.group.WORLD, bucket)

    def next_microbatch(module, args):
        where["microbatch"] += 1

    ddp.register_comm_hook(None, counting_hook)
    ddp.register_forward_pre_hook(next_microbatch)
    for w, batches in enumerate(windows):
        where.update(window=w, microbatch=-1)
        engine.run_window(list(batches), w)
    return calls


# ----------------------------------------------------------------- the layout's groups


def layout_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """Join a ``world``-rank gloo job, build ``job['sizes']``'s layout by hand (the
    launcher path refuses axes this build does not run yet), and record this rank's
    coordinates, the members of its group on each axis and the reducer's sums of
    ``rank + 1`` (``sum``: over the replicas; ``agree``: over every rank)."""
    from dataclasses import replace as replace_ctx
    from datetime import timedelta

    import torch.distributed as dist

    from exactstep.parallel.layout import DIMS, build_layout

    def body(ctx, result: dict) -> None:
        layout = build_layout(job["sizes"], ctx.rank, "cpu", "gloo", timedelta(seconds=30),
                              ctx.host_group)
        result["coords"] = layout.coords()
        result["members"] = {dim: (dist.get_process_group_ranks(layout.group(dim))
                                   if layout.group(dim) is not None else [ctx.rank])
                             for dim in DIMS}
        reducer = DDPReducer(replace_ctx(ctx, layout=layout))
        value = torch.tensor([float(ctx.rank + 1)], dtype=torch.float64)
        result["sum"] = float(reducer.sum(value)[0])
        result["agree"] = float(reducer.agree(value)[0])
        result["replicas"] = reducer.world_size
        result["loss_owner"] = reducer.loss_owner
        result["gathered"] = reducer.gather(ctx.rank)
        result["submesh_dp"] = (None if layout.submesh("dp") is None
                                else layout.submesh("dp").mesh.tolist())

    run_rank(rank, world, port, out, ParallelConfig(timeout_s=30.0), body)
