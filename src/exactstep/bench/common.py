"""Shared helpers for benchmarks: interleaved timing and one output convention.

Every benchmark defines ``run(quick: bool) -> dict`` of plainly named figures measured
against a baseline in the same process, and a one-paragraph ``__doc__``; timings
alternate candidate and baseline so machine noise hits both alike. A side whose peak
memory must be its own runs in a fresh interpreter (``run_child``); ``whole_rows`` is a
model seen without its key-value cache (the sampler's baseline).
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
    """Human-readable lines, one figure per line."""
    lines = [f"bench {name}"]
    for key, value in figures.items():
        if isinstance(value, float):
            lines.append(f"  {key:<28} {value:.4g}")
        else:
            lines.append(f"  {key:<28} {value}")
    return "\n".join(lines)


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

