"""Objective families (R8): packing efficiency and training throughput against causal LM.

Every built family trains the same model size on its built-in data through the real
run, alternating window by window with the causal baseline; ``exactstep bench
families`` reports each one's ``efficiency``, ``tokens_per_s``, ``targets_per_s`` and
``time_ratio``.
Design and derivations: docs/design/bench.md#benchfamiliespy (R8).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from exactstep.bench.common import median
from exactstep.families import BUILT

SETTINGS = (
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=172",
    "batch.seq_len=256", "batch.rows=8", "update.accum=1", "train.progress=false",
    "data.max_docs=400", "data.val_fraction=0.1", "train.threads=0", "train.device=cpu",
)


def family_run(name: str, root: Path):
    """A built run of family ``name`` (nothing trained yet) and its window iterator."""
    from exactstep.config import load_config
    from exactstep.run.runner import build_run

    cfg = load_config(None, [*SETTINGS, f"objective.family={name}", "train.steps=1000"])
    run = build_run(cfg, root / name)
    return run, iter(run.stream)


def window_tokens(batch) -> tuple[int, int]:
    """(input tokens, supervised targets) of one microbatch; the encoder side counts."""
    inputs = int((batch.segment_ids > 0).sum())
    if batch.source is not None:
        inputs += int((batch.source.segment_ids > 0).sum())
    return inputs, batch.num_targets()


def run(quick: bool) -> dict:
    windows = 4 if quick else 12
    names = list(BUILT)
    figures: dict = {"families": ",".join(names), "windows": windows}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: family_run(name, Path(tmp)) for name in names}
        seconds: dict[str, list[float]] = {name: [] for name in names}
        counts = {name: [0, 0] for name in names}
        for w in range(windows + 1):  # window 0 warms up every family
            order = names if w % 2 == 0 else names[::-1]
            for name in order:
                run_, stream = runs[name]
                batch = next(stream)
                t0 = time.perf_counter()
                run_.engine.run_window([batch], w)
                dt = time.perf_counter() - t0
                if w:
                    seconds[name].append(dt)
                    inputs, targets = window_tokens(batch)
                    counts[name][0] += inputs
                    counts[name][1] += targets
        base = median(seconds["causal"])
        for name in names:
            total = sum(seconds[name])
            figures[f"{name}_efficiency"] = runs[name][0].stream.report()["efficiency"]
            figures[f"{name}_tokens_per_s"] = counts[name][0] / total
            figures[f"{name}_targets_per_s"] = counts[name][1] / total
            figures[f"{name}_time_ratio"] = median(seconds[name]) / base
    return figures


if __name__ == "__main__":
    from exactstep.bench.common import format_figures

    print(format_figures("families", run(quick=True)))
