"""The default run as a user runs it, against the same run under the old 128 KiB pin (L1, X1).

Each side is the whole command ``exactstep train --set train.steps=N`` in a fresh
process; its user and system CPU seconds and peak resident set come from the kernel
(``wait4``), its training windows/s and supervised tokens/s from the run's own
``metrics.jsonl`` and ``summary.json``. The baseline runs with glibc's mmap threshold
pinned at 128 KiB (every tensor above it a fresh mapping): the leanest resident set,
and the fault storm this benchmark guards against (``system_user_ratio``).
Design and derivations: docs/design/bench.md#benchdefaultpy (L1, X1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exactstep.bench.common import median

#: windows per pass and passes per side
FULL = {"steps": 100, "rounds": 3}
QUICK = {"steps": 10, "rounds": 1}
#: the baseline's environment: glibc reads it at start-up, and the run's own pin
#: then steps aside (``run.host_memory.users_own_setting``)
OLD_PIN = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
SIDES = {"default": {}, "old_pin": OLD_PIN}


def run(quick: bool) -> dict:
    shape = QUICK if quick else FULL
    passes: dict[str, list[dict]] = {name: [] for name in SIDES}
    for round_ in range(shape["rounds"]):
        order = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
        for name in order:
            passes[name].append(one_pass(shape["steps"], SIDES[name]))
    figures: dict = {"steps": shape["steps"], "rounds": shape["rounds"]}
    for name, side in passes.items():
        figures.update({f"{name}_{key}": value for key, value in summarise(side).items()})
    # ratios per round (the two passes next to each other in time), then their median
    rounds = list(zip(passes["default"], passes["old_pin"], strict=True))
    figures["speedup"] = median([a["windows_per_s"] / b["windows_per_s"] for a, b in rounds])
    figures["memory_ratio"] = median([a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in rounds])
    figures["same_loss"] = (figures["default_final_loss"] == figures["old_pin_final_loss"])
    return figures


def summarise(side: list[dict]) -> dict:
    """Medians over passes."""
    out = {key: median([p[key] for p in side]) for key in (
        "windows_per_s", "tokens_per_s", "wall_s", "user_s", "system_s", "peak_rss_mib")}
    out["system_user_ratio"] = out["system_s"] / out["user_s"]
    out["threads"] = side[0]["threads"]
    out["final_loss"] = side[0]["final_loss"]
    out["passes"] = [{k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()}
                     for p in side]
    return out


def one_pass(steps: int, env: dict[str, str], sets: tuple[str, ...] = (),
             read: Callable[[Path, float, Any], dict] | None = None) -> dict:
    """One whole ``exactstep train --set train.steps=STEPS SETS...`` in a fresh process;
    ``read(run_dir, wall_s, rusage)`` (``pass_figures`` by default) gives its figures."""
    environ = {k: v for k, v in os.environ.items() if k not in OLD_PIN}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "exactstep", "train", "--no-progress", "--out",
                   str(out), "--set", f"train.steps={steps}", *sets]
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 env={**environ, **env})
        stderr = child.stderr.read() if child.stderr else b""
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise RuntimeError(f"bench: the run failed:\n{stderr.decode()[-3000:]}")
        return (read or pass_figures)(out, wall, usage)


def pass_figures(out: Path, wall: float, usage) -> dict:
    """A finished run's figures: the training loop's rate from its last metrics line
    (``elapsed_s`` counts from its first window), CPU and memory from ``wait4``."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    summary = json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())["manifest"]
    ledger = (out / "ledger.jsonl").read_text().splitlines()
    return {
        "windows_per_s": last["window"] / last["elapsed_s"],
        "tokens_per_s": summary["supervised_tokens"] / last["elapsed_s"],
        "wall_s": wall,
        "user_s": usage.ru_utime,
        "system_s": usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "threads": manifest["environment"]["threads"],
        "final_loss": json.loads(ledger[-1])["loss"],
    }
