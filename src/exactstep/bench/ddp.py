"""Per-window cost of the distributed transaction against plain DDP (D1, D2, U7).

Two CPU ranks run exactstep's agreed window (agreed count, ``DDPReducer``, agreed
stop) and a plain DDP accumulation loop, alternating window by window;
``exactstep bench ddp`` reports ``time_ratio``, the overhead and extra collectives,
and the same window under torchrun's launcher as 2 "nodes" x 1 process (two
launchers, a c10d rendezvous on localhost) against 1 node x 2 processes.
Design and derivations: docs/design/bench.md#benchddppy (D1, D2, U7).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import torch

from exactstep.bench.common import spawn_ranks

VOCAB = 32
PAD_ID = 0


def _examples(n: int = 24, seed: int = 0) -> list:
    """``n`` documents of 3..20 random tokens (ids in [1, VOCAB))."""
    import numpy as np

    from exactstep.rows.example import Example

    rng = np.random.default_rng(seed)
    return [Example(i, rng.integers(1, VOCAB, size=int(rng.integers(3, 21))).astype(np.int64))
            for i in range(n)]


def _batch_cfg():
    from exactstep.rows.config import BatchConfig

    return BatchConfig(seq_len=16, rows=2, buffer=8)


def _stream(rank: int, world: int):
    from exactstep.rows.stream import RowStream

    return RowStream(_examples(), _batch_cfg(), pad_id=PAD_ID, seed=3, rank=rank, world=world,
                     vocab_size=VOCAB)


def _engine():
    """A small decoder under the window transaction (AdamW, clip 1, fp32)."""
    from exactstep.model.config import ModelConfig
    from exactstep.model.decoder import build_model
    from exactstep.objective.config import ObjectiveConfig
    from exactstep.update.config import NumericsConfig, UpdateConfig
    from exactstep.update.groups import build_optimizer
    from exactstep.update.precision import Precision
    from exactstep.update.schedule import build_schedule
    from exactstep.update.window import UpdateEngine

    update = UpdateConfig(accum=2, optimizer="adamw", lr=1e-2, warmup=0, schedule="constant",
                          clip=1.0, weight_decay=0.1)
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32,
                                    attention="dense"), VOCAB, seed=0)
    optimizer, _ = build_optimizer(model, update)
    return UpdateEngine(model, optimizer, build_schedule(update, total_windows=100),
                        Precision(NumericsConfig(), "cpu"), update, ObjectiveConfig(),
                        device=torch.device("cpu"), pad_id=PAD_ID)


def _plain_window(module, optimizer, batches, plan_window, cfg, clip: float) -> None:
    """The usual DDP loop: mean of microbatch means, no agreement across ranks."""
    plan = plan_window(batches, cfg)
    last = len(batches) - 1
    for index, (batch, coeff) in enumerate(zip(batches, plan.coefficients, strict=True)):
        with module.no_sync() if index < last else contextlib.nullcontext():
            numerator, _ = module(batch, coeff)
            (numerator / max(plan.microbatch_denominators[index], 1.0) / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _rank(rank: int, world: int, port: int, out: str, job: dict) -> None:
    from exactstep.objective import plan_window
    from exactstep.objective.config import ObjectiveConfig
    from exactstep.parallel.agreement import agreed_stop, agreed_window, distribute_engine
    from exactstep.parallel.config import ParallelConfig
    from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown

    torch.set_num_threads(1)
    cfg = ParallelConfig(timeout_s=60.0)
    ctx = init_distributed(cfg, "cpu", env=launcher_env(rank, world, port))
    try:
        exact = distribute_engine(_engine(), ctx, cfg)
        plain = distribute_engine(_engine(), ctx, cfg)
        plain_module, plain_opt = plain.train_module, plain.optimizer
        stream = _stream(rank, world)
        it = iter(stream)
        k, windows = job["accum"], job["windows"]
        pool = [[next(it) for _ in range(k)] for _ in range(8)]
        times: dict[str, list[float]] = {"exact": [], "plain": []}
        for w in range(windows + 2):
            batches = pool[w % len(pool)]
            order = ("exact", "plain") if w % 2 == 0 else ("plain", "exact")
            for name in order:
                torch.distributed.barrier()
                t0 = time.perf_counter()
                if name == "exact":  # what the runner does per window, agreements included
                    agreed_window(iter(batches), k, exact.reducer, rows=_batch_cfg().rows,
                                  seq_len=_batch_cfg().seq_len, pad_id=PAD_ID)
                    exact.run_window(batches, w)
                    agreed_stop(False, exact.reducer)
                else:
                    _plain_window(plain_module, plain_opt, batches, plan_window,
                                  ObjectiveConfig(), 1.0)
                if w >= 2:  # the first two windows warm up
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            torch.save({**times, "collectives": exact.reducer.collectives,
                        "windows": windows + 2, "rows": _batch_cfg().rows}, Path(out) / "times.pt")
    finally:
        shutdown(ctx)


# ----------------------------------------------------------- 2 nodes x 1 vs 1 node x 2


def _launched_rank(out: str, tag: str, job: dict) -> None:
    """One worker under torchrun's agent: the runner's per-window protocol, timed."""
    from exactstep.parallel.agreement import agreed_stop, agreed_window, distribute_engine
    from exactstep.parallel.config import ParallelConfig
    from exactstep.parallel.process_group import init_distributed, shutdown

    torch.set_num_threads(1)
    cfg = ParallelConfig(timeout_s=60.0)
    ctx = init_distributed(cfg, "cpu")  # the variables torchrun's agent set
    try:
        engine = distribute_engine(_engine(), ctx, cfg)
        it = iter(_stream(ctx.rank, ctx.world_size))
        k, rows, seq_len = job["accum"], _batch_cfg().rows, _batch_cfg().seq_len
        pool = [[next(it) for _ in range(k)] for _ in range(8)]
        times = []
        for w in range(job["windows"] + 2):
            batches = pool[w % len(pool)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            agreed_window(iter(batches), k, engine.reducer, rows=rows, seq_len=seq_len,
                          pad_id=PAD_ID)
            engine.run_window(batches, w)
            agreed_stop(False, engine.reducer)
            if w >= 2:  # the first two windows warm up
                times.append(time.perf_counter() - t0)
        if ctx.rank == 0:
            torch.save(times, Path(out) / f"{tag}.pt")
    finally:
        shutdown(ctx)


def _node(nnodes: int, node_rank: int, nproc: int, endpoint: str, out: str, tag: str,
          job: dict) -> None:
    """One node's launcher (torchrun's agent in this process) running ``nproc`` workers."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from exactstep.parallel.launch import quiet_launcher_logs

    quiet_launcher_logs()
    rdzv = {"timeout": 120, **({"is_host": node_rank == 0} if nnodes > 1 else {})}
    config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc,
                          run_id=f"bench-{tag}", rdzv_backend="c10d", rdzv_endpoint=endpoint,
                          rdzv_configs=rdzv, max_restarts=0, monitor_interval=0.5,
                          logs_specs=DefaultLogsSpecs(log_dir=str(Path(out) / f"logs-{tag}-"
                                                                  f"{node_rank}")))
    elastic_launch(config, _launched_rank)(out, tag, job)


def _layout(nnodes: int, nproc: int, out: Path, tag: str, job: dict) -> list[float]:
    """Seconds per window of one job laid out as ``nnodes`` launchers x ``nproc``."""
    from exactstep.parallel.process_group import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    nodes = [ctx.Process(target=_node, args=(nnodes, n, nproc, endpoint, str(out), tag, job))
             for n in range(nnodes)]
    for p in nodes:
        p.start()
    for p in nodes:
        p.join(600)
        if p.is_alive():
            p.kill()
            p.join(5)
    file = out / f"{tag}.pt"
    if not file.exists():
        raise RuntimeError(f"bench ddp: the {tag} job exited with "
                           f"{[p.exitcode for p in nodes]} and wrote no timings")
    return torch.load(file, weights_only=False)


def node_layouts(job: dict, rounds: int) -> dict:
    """2 "nodes" x 1 process against 1 node x 2 processes: each round runs both jobs
    back to back (the order alternating by round); the ratio is the median of the
    rounds' ratios of median window times, so a load change between rounds cancels."""
    times: dict[str, list[float]] = {"2x1": [], "1x2": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = ("1x2", "2x1") if r % 2 == 0 else ("2x1", "1x2")
            medians = {}
            for tag in order:
                nnodes, nproc = (int(x) for x in tag.split("x"))
                got = _layout(nnodes, nproc, Path(tmp), f"{tag}-{r}", job)
                times[tag] += got
                medians[tag] = statistics.median(got)
            ratios.append(medians["2x1"] / medians["1x2"])
    two, one = statistics.median(times["2x1"]), statistics.median(times["1x2"])
    return {
        "two_nodes_ms_per_window": two * 1e3,
        "one_node_ms_per_window": one * 1e3,
        "two_nodes_ratio": statistics.median(ratios),
        "two_nodes_round_ratios": ratios,
        "two_nodes_overhead_ms_per_window": (two - one) * 1e3,
        "two_nodes_windows_timed": len(times["2x1"]),
    }


def run(quick: bool) -> dict:
    job = {"accum": 4, "windows": 10 if quick else 40}
    with tempfile.TemporaryDirectory() as tmp:
        codes = spawn_ranks(_rank, 2, (tmp, job), deadline_s=600)
        file = Path(tmp) / "times.pt"
        if not file.exists():
            raise RuntimeError(f"bench ddp: ranks exited with {codes} and wrote no timings")
        data = torch.load(file, weights_only=False)
    exact, plain = statistics.median(data["exact"]), statistics.median(data["plain"])
    layouts = node_layouts(job, rounds=1 if quick else 3)
    return {
        "world_size": 2,
        "accum": job["accum"],
        "windows_timed": len(data["exact"]),
        "exact_ms_per_window": exact * 1e3,
        "plain_ddp_ms_per_window": plain * 1e3,
        "time_ratio": exact / plain,
        "overhead_ms_per_window": (exact - plain) * 1e3,
        "extra_collectives_per_window": data["collectives"] / data["windows"],
        **layouts,
    }
