"""Shared helpers for benchmarks: interleaved timing and one output convention.

Every benchmark defines ``run(quick: bool) -> dict`` of plainly named figures measured
against a baseline in the same process, and a one-paragraph ``__doc__``; timings
alternate candidate and baseline so machine noise hits both alike.
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
