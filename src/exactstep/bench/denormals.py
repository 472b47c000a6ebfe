"""The whole default run with denormals flushed (the default) against the same run
computing on them (``numerics.flush_denormal = false``), side by side (S9, X1).

Each side is ``exactstep train`` (800 windows; ``--quick``: 400) in a fresh process.
Reported per side: the training loop's time and supervised tokens/s, tokens/s per
100-window stretch (the unflushed run slows once AdamW's moments of unused embedding
rows decay into denormals), held-out bits per byte, and the first window whose ledger
line differs between the sides (flushing changes values only once denormals appear).
Design and figures: docs/design/bench.md#benchdenormalspy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exactstep.bench.common import median
from exactstep.bench.default import one_pass

FULL = {"steps": 800}
QUICK = {"steps": 400}
STRETCH = 100  # windows per tokens/s figure
SIDES = {"flushed": (), "unflushed": ("numerics.flush_denormal=false",)}


def run(quick: bool) -> dict:
    steps = (QUICK if quick else FULL)["steps"]
    passes = {name: one_pass(steps, {}, ("--set", *sets) if sets else (), read=figures_of)
              for name, sets in SIDES.items()}
    flushed, unflushed = passes["flushed"], passes["unflushed"]
    ledgers = [p.pop("ledger") for p in (flushed, unflushed)]
    out: dict[str, Any] = {"steps": steps}
    for name, side in passes.items():
        out.update({f"{name}_{key}": value for key, value in side.items()})
    out["speedup"] = unflushed["loop_s"] / flushed["loop_s"]
    out["first_differing_window"] = next(
        (i for i, (a, b) in enumerate(zip(*ledgers, strict=True)) if a != b), None)
    return out


def figures_of(out: Path, wall: float, usage: Any) -> dict:
    """One finished run: its loop time and rates from ``metrics.jsonl``, its held-out
    bits per byte from ``summary.json``, its ledger lines (for the comparison)."""
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    intervals = [m for m in metrics if "tokens_per_s" in m]
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    stretches: dict[int, list[float]] = {}
    for m in intervals:
        stretches.setdefault((m["window"] - 1) // STRETCH, []).append(m["tokens_per_s"])
    return {
        "wall_s": wall,
        "loop_s": intervals[-1]["elapsed_s"],
        "user_s": usage.ru_utime,
        "system_s": usage.ru_stime,
        "supervised_tokens_per_s": summary["supervised_tokens"] / intervals[-1]["elapsed_s"],
        "tokens_per_s_by_stretch": {f"{k * STRETCH}-{(k + 1) * STRETCH}": round(median(v))
                                    for k, v in sorted(stretches.items())},
        "heldout_bits_per_byte": summary["heldout_bits_per_byte"],
        "flush_denormal": manifest["environment"]["flush_denormal"],
        "threads": manifest["environment"]["threads"],
        "ledger": (out / "ledger.jsonl").read_text().splitlines(),
    }
