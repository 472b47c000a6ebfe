"""Shared helpers for benchmarks: interleaved timing and one output convention.

Every benchmark defines ``run(quick: bool) -> dict`` of plainly named figures measured
against a baseline in the same process, and a one-paragraph ``__doc__``; timings
alternate candidate and baseline so machine noise hits both alike. A side whose peak
memory must be its own runs in a fresh interpreter (``run_child``), ranks of a job in
spawned processes (``spawn_ranks``); ``status_kib``, ``reset_peak`` and ``cpu_model``
read what the figures name; ``whole_rows`` is a model seen without its key-value cache
(the sampler's baseline).
Design and derivations: docs/design/bench.md#benchcommonpy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved_times(
    candidate: Callable[[], object],
    baseline: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
) -> tuple[list[float], list[float]]:
    """Run candidate and baseline alternately; return per-run seconds of each."""
    for _ in range(warmup):
        candidate()
        baseline()
    cand, base = [], []
    for i in range(repeats):
        order = (candidate, baseline) if i % 2 == 0 else (baseline, candidate)
        for fn in order:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            (cand if fn is candidate else base).append(dt)
    return cand, base


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def format_figures(name: str, figures: dict) -> str:
    """Human-readable lines, one figure per line; a dict of figures is a block of its
    own lines, indented under its key."""
    return "\n".join([f"bench {name}", *_figure_lines(figures, "  ")])


def _figure_lines(figures: dict, indent: str) -> list[str]:
    lines = []
    for key, value in figures.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}")
            lines += _figure_lines(value, indent + "  ")
        elif isinstance(value, float):
            lines.append(f"{indent}{key:<28} {value:.4g}")
        else:
            lines.append(f"{indent}{key:<28} {value}")
    return lines


def run_child(module: str, spec: dict, name: str) -> dict:
    """One side in a fresh interpreter (``python -m module SPEC_JSON``) at
    ``spec["threads"]`` threads, so its ``VmHWM`` is its own: its last stdout line, a
    JSON object; ``RuntimeError`` with the child's stderr tail if it fails."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]),
           "MKL_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-m", module, json.dumps(spec)],
                          capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"bench {name} child {spec['side']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spawn_ranks(target: Callable, world: int, args: tuple, *, deadline_s: float
                ) -> list[int | None]:
    """Start ``world`` spawned processes ``target(rank, world, port, *args)`` (a free
    localhost port for their process group), join them by ``deadline_s``, kill those
    left; their exit codes (None: killed)."""
    import multiprocessing as mp

    from exactstep.parallel.process_group import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args), daemon=True)
             for r in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, deadline_s - (time.monotonic() - start)))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    return [p.exitcode for p in procs]


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``: the peak)."""
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """Reset this process's peak resident set (``VmHWM``) to its current one (Linux's
    ``clear_refs`` 5); where that is refused the peak keeps the build's."""
    from pathlib import Path

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it, and the cores this process
    may use."""
    import os
    from pathlib import Path

    name = "unknown"
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def whole_rows(model):  # noqa: ANN001, ANN201 - torch is imported lazily here
    """``model`` seen without its key-value cache: ``forward`` and ``logits`` only, so
    ``sample_group`` reruns whole rows each step (the cached sampler's baseline)."""
    import torch

    class WholeRows(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, batch):  # noqa: ANN001, ANN202
            return self.inner(batch)

        def logits(self, hidden):  # noqa: ANN001, ANN202
            return self.inner.logits(hidden)

    return WholeRows()

