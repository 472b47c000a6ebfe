"""Parallel layouts against DDP on the same model: tokens/s and per-rank memory (D1, D4, D5).

Each layout (``ddp``, ``fsdp``, ``zero1``, ``zero2``, ``tp2``, ``pp2``: one entry of
``LAYOUTS``, ``--set`` keys of the run, so a new layout is one more row) trains the
same built-in decoder on the same global windows as a real run does
(``run.runner.build_run`` on every rank), two spawned gloo ranks on this CPU, one
thread each. ``exactstep bench parallel``
reports per shape and layout ``tokens_per_s``, per-rank peak RSS and the parameter,
gradient and optimizer-state bytes a rank holds, and their ratios to DDP's.
Design and derivations: docs/design/bench.md#benchparallelpy (D1, D4, D5).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from exactstep.bench.common import cpu_model, reset_peak, spawn_ranks, status_kib

WORLD = 2
# layout name -> the run's settings that make it and its data replicas among the WORLD
# ranks (tp / pp rows add theirs here); a layout of fewer replicas takes proportionally
# more microbatches a window, so every layout trains the same global windows
LAYOUTS: dict[str, tuple[tuple[str, ...], int]] = {
    "ddp": (("parallel.strategy=ddp",), 2),
    "fsdp": (("parallel.strategy=fsdp",), 2),
    "zero1": (("parallel.strategy=zero1",), 2),
    "zero2": (("parallel.strategy=zero2",), 2),
    "tp2": (("parallel.tp=2",), 1),  # one replica split in 2 tensor shards
    "pp2": (("parallel.pp=2",), 1),  # one replica in 2 pipeline stages (1f1b)
}
BASELINE = "ddp"
COMMON = ("train.device=cpu", "train.threads=1", "train.progress=false",
          "train.prefetch=0", "train.steps=1000", "data.max_docs=400",
          "data.val_fraction=0.1", "update.warmup=0", "update.clip=1.0")
# shape name -> model and batch settings; d512 is the built-in decoder at a real width
SHAPES: dict[str, tuple[str, ...]] = {
    "d64": ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=172",
            "batch.seq_len=128", "batch.rows=4", "update.accum=2"),
    "d512": ("model.d_model=512", "model.n_layers=2", "model.n_heads=8", "model.d_ff=1376",
             "batch.seq_len=256", "batch.rows=2", "update.accum=2"),
}
QUICK_SHAPES: dict[str, tuple[str, ...]] = {
    "d16": ("model.d_model=16", "model.n_layers=2", "model.n_heads=2", "model.d_ff=32",
            "batch.seq_len=32", "batch.rows=2", "update.accum=2"),
}


def local_bytes(tensors) -> int:  # noqa: ANN001 - tensors or DTensors
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _rank(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: build the run (``build_run``, as ``exactstep train`` does), train one
    window to warm up and ``job['windows']`` timed ones; write its figures."""
    import torch

    from exactstep.config import load_config
    from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown
    from exactstep.parallel.zero import optimizer_state_bytes
    from exactstep.run.runner import build_run

    torch.set_num_threads(1)
    cfg = load_config(None, list(job["settings"]))
    ctx = init_distributed(cfg.parallel, "cpu", env=launcher_env(rank, world, port))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            run = build_run(cfg, Path(tmp) / "run", ctx=ctx)  # writes nothing
            engine, it = run.engine, iter(run.stream)
            grads: list[int] = []  # this rank's gradient bytes as each step starts
            engine.optimizer.register_step_pre_hook(
                lambda *_: grads.append(local_bytes(p.grad for p in engine.parameters)))
            reset_peak()  # the peak from here on is the training's, not the build's
            seconds, tokens = [], 0
            coords = ctx.layout.coords()  # a replica's batches counted on its first rank
            counts = coords["tp"] == coords["pp"] == coords["cp"] == 0
            for w in range(1 + job["windows"]):  # window 0 warms up
                batches = [next(it) for _ in range(cfg.update.accum)]
                torch.distributed.barrier()
                t0 = time.perf_counter()
                engine.run_window(batches, w)
                dt = time.perf_counter() - t0
                if w:
                    seconds.append(dt)
                    tokens += counts * sum(int((b.segment_ids > 0).sum()) for b in batches)
            figures = {
                "seconds": seconds, "tokens": tokens,
                "peak_rss_mib": status_kib("VmHWM") / 1024,
                "param_bytes": local_bytes(run.model.parameters()),
                "grad_bytes": max(grads, default=0),
                "optimizer_bytes": optimizer_state_bytes(engine.optimizer),
                "parameters": run.model.num_parameters(),
            }
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        shutdown(ctx)


def layout_job(settings: tuple[str, ...], windows: int) -> dict:
    """One layout's two ranks in fresh processes (each peak is its own): rank 0's
    window seconds, the tokens of every data replica, the largest rank's memory."""
    with tempfile.TemporaryDirectory() as tmp:
        codes = spawn_ranks(_rank, WORLD, (tmp, {"settings": settings, "windows": windows}),
                            deadline_s=900)
        files = [Path(tmp) / f"rank{r}.json" for r in range(WORLD)]
        if not all(f.exists() for f in files):
            raise RuntimeError(f"bench parallel: ranks of {' '.join(settings[-1:])} exited "
                               f"with {codes} and wrote no figures")
        ranks = [json.loads(f.read_text()) for f in files]
    return {"seconds": ranks[0]["seconds"], "tokens": sum(r["tokens"] for r in ranks),
            "parameters": ranks[0]["parameters"],
            **{key: max(r[key] for r in ranks) for key in
               ("peak_rss_mib", "param_bytes", "grad_bytes", "optimizer_bytes")}}


def layout_settings(shape: tuple[str, ...], name: str) -> tuple[str, ...]:
    """The run settings of layout ``name`` at ``shape``: ``update.accum`` scaled by
    ``WORLD / replicas``, so the global window (microbatches over all replicas) is the
    same in every layout."""
    settings, replicas = LAYOUTS[name]
    accum = next(int(v.split("=")[1]) for v in shape if v.startswith("update.accum="))
    return (*COMMON, *shape, *settings, f"update.accum={accum * WORLD // replicas}")


def shape_rows(shape: tuple[str, ...], windows: int, rounds: int) -> dict:
    """Every layout at one shape: ``rounds`` rounds, each running every layout once
    (the order reversed every other round, so a load change hits all alike); per
    layout the median window time over all rounds and the memory of the first."""
    names = list(LAYOUTS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runs[name].append(layout_job(layout_settings(shape, name), windows))
    rows = {}
    for name in names:
        got = runs[name]
        tokens = [g["tokens"] for g in got]
        seconds = statistics.median([s for g in got for s in g["seconds"]])
        held = {k: got[0][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")}
        rows[name] = {
            "tokens": tokens[0], "tokens_per_s": tokens[0] / windows / seconds,
            "ms_per_window": seconds * 1e3, "peak_rss_mib": got[0]["peak_rss_mib"],
            **held, "held_bytes": sum(held.values()), "parameters": got[0]["parameters"],
            "same_tokens_every_round": len(set(tokens)) == 1,
        }
    base = rows[BASELINE]
    for row in rows.values():
        row["time_ratio"] = row["ms_per_window"] / base["ms_per_window"]
        row["memory_ratio"] = row["held_bytes"] / base["held_bytes"]
        row["optimizer_ratio"] = row["optimizer_bytes"] / base["optimizer_bytes"]
        row["rss_ratio"] = row["peak_rss_mib"] / base["peak_rss_mib"]
    return rows


def run(quick: bool) -> dict:
    shapes = QUICK_SHAPES if quick else SHAPES
    windows, rounds = (2, 1) if quick else (4, 2)
    figures: dict = {"cpu": cpu_model(), "world_size": WORLD, "threads_per_rank": 1,
                     "baseline": BASELINE, "layouts": ",".join(LAYOUTS),
                     "windows_timed": windows, "rounds": rounds}
    for name, shape in shapes.items():
        figures[name] = {"settings": " ".join(shape), **shape_rows(shape, windows, rounds)}
    return figures
