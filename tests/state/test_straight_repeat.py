"""S5: the same command run again from scratch gives the same bytes.

A straight run must be reproducible before a resume can be compared with it: on one
Intel Xeon, 1 of 22 straight runs of the default configuration at two threads gave
another window-0 loss. Here the default model and batch shapes (16 x 256 tokens,
d_model 128, 4 layers), on the first 300 documents of the built-in corpus, train 3
windows at two threads in separate fresh interpreters (real processes, not forks of
one: each starts with its own heap, addresses and hash seed, so whatever depends on
memory layout or on set order differs between them), and every ledger, metrics line
(timings aside) and final checkpoint tensor must be bitwise equal.

Negative control: the same comparison tells a run with another seed from the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint

pytestmark = pytest.mark.slow

SETTINGS = ["train.steps=3", "data.max_docs=300", "train.threads=2", "train.eval_tokens=256",
            "train.device=cpu", "checkpoint.every=0"]
HASH_SEEDS = ("0", "1", "4242")


def straight(root: Path, name: str, hash_seed: str, *extra: str) -> Path:
    """One run in a fresh interpreter (``subprocess``: a real process)."""
    out = root / name
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    env["PYTHONHASHSEED"] = hash_seed
    done = subprocess.run([sys.executable, "-m", "exactstep", "train", "--no-progress",
                           "--out", str(out), *[a for s in (*SETTINGS, *extra)
                                                for a in ("--set", s)]],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def record(run: Path) -> tuple[bytes, list[dict], dict]:
    """The ledger's bytes, the metrics lines without their timings, the final state."""
    metrics = [{k: v for k, v in json.loads(line).items()
                if k not in ("tokens_per_s", "elapsed_s")}
               for line in (run / "metrics.jsonl").read_text().splitlines()]
    model, parts = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    return (run / "ledger.jsonl").read_bytes(), metrics, {"model": model, **parts}


def differences(a: tuple, b: tuple) -> list[str]:
    found = []
    if a[0] != b[0]:
        found.append("ledger")
    if a[1] != b[1]:
        found.append("metrics")
    return found + state_differences(a[2], b[2])


def test_straight_runs_in_fresh_processes_are_bitwise_equal(tmp_path):
    with ThreadPoolExecutor(2) as pool:  # two at a time: each also runs beside another
        other = pool.submit(straight, tmp_path, "other-seed", "0", "seed=1")
        runs = list(pool.map(lambda s: straight(tmp_path, f"run-{s}", s), HASH_SEEDS))
        other = other.result()
    first, *rest = (record(run) for run in runs)
    for run, got in zip(runs[1:], rest, strict=True):
        assert differences(first, got) == [], run.name
    assert len(first[0].splitlines()) == 3
    # negative control: the comparison sees a run that is not the same
    assert "ledger" in differences(first, record(other))
