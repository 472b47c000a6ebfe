"""fp16 state across SIGKILL and resume (S5, U2, S2), with the process killed from outside.

A run in ``numerics.precision = fp16`` starts with a loss scale of 2^24, too large for
this model's fp16 gradients: its first windows overflow and are skipped, each halving
the scale, and ``update.fail_window`` forces one more skip later, so by the time the
process is SIGKILLed (by the test, once the ledger shows a checkpoint published after
that skip) the scaler's scale and growth tracker are far from their initial values.
``exactstep resume`` must then end bitwise equal to an uninterrupted run: model,
optimizer, scheduler, scaler (scale and growth tracker), counters, RNG, data cursor,
and the ledger byte for byte. The final scaler state also equals its closed form read
off the ledger: the initial scale halved once per skipped window, the tracker counting
the commits since the last skip.

Negative control: the same resume with ``GradScaler.load_state_dict`` disabled (the
scaler state dropped) restarts at 2^24, overflows again and ends elsewhere.
Nothing inside exactstep is patched: the kill comes from this process, and the
defect is applied to PyTorch's own class. Only the killed run is a child process;
the uninterrupted run and the resumes go through ``exactstep.cli.main`` here (one
thread each, as the child), which spares three interpreter start-ups.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import process_server
import pytest
import torch
from run_support import TINY, bitwise_differences, kill_when_ledger_has, ledger, set_args
from text_corpus import write_corpus

from exactstep.cli import main
from exactstep.state import latest_checkpoint, load_checkpoint, verify_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, EVERY = 30, 2
INIT_SCALE = 2.0**24
FAIL_WINDOW = 6
KILL_AFTER_LINES = FAIL_WINDOW + 3  # line 9 is written after checkpoint window-8 is published

def settings(corpus: Path) -> list[str]:
    return set_args({
        "seed": 3, "data.source": corpus, "data.val_fraction": 0.2, **TINY,
        "update.accum": 2, "update.warmup": 2, "update.fail_window": FAIL_WINDOW,
        "numerics.precision": "fp16", "numerics.init_scale": INIT_SCALE,
        "train.steps": STEPS, "train.eval_tokens": 64, "train.threads": 1, "train.device": "cpu",
        "checkpoint.every": EVERY, "checkpoint.keep": 2,
    })


def in_process(*argv: str) -> None:
    """``exactstep ARGV`` in this process, on one thread (restored afterwards)."""
    threads = torch.get_num_threads()
    try:
        assert main([*argv, "--set", "train.threads=1"]) == 0
    finally:
        torch.set_num_threads(threads)


def final_state(run_dir: Path) -> dict:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None and path.name == f"window-{STEPS:08d}"
    model, parts = load_checkpoint(path)
    return {"model": model, **parts}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp16_kill")
    corpus = root / "corpus.jsonl"
    write_corpus(corpus)
    straight, killed, dropped = root / "straight", root / "killed", root / "dropped"
    proc = process_server.Popen(
        [sys.executable, "-m", "exactstep", "train", "--no-progress", "--out", str(killed),
         *settings(corpus)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with ThreadPoolExecutor(max_workers=1) as pool:
        watcher = pool.submit(kill_when_ledger_has, proc, killed, KILL_AFTER_LINES)
        in_process("train", "--no-progress", "--out", str(straight), *settings(corpus))
        watcher.result()
    at_kill = latest_checkpoint(killed / "checkpoints")
    assert at_kill is not None and verify_checkpoint(at_kill).ok
    _, parts_at_kill = load_checkpoint(at_kill)
    shutil.copytree(killed, dropped)
    in_process("resume", "--no-progress", str(killed))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.amp.GradScaler, "load_state_dict", lambda self, state: None)  # WRONG
        in_process("resume", "--no-progress", str(dropped))
    return {"straight": straight, "killed": killed, "dropped": dropped,
            "at_kill": (at_kill.name, parts_at_kill)}


def closed_form_scaler(records: list[dict]) -> tuple[float, int]:
    """GradScaler's arithmetic from the ledger: x0.5 per skipped window, the tracker
    counts commits since the last skip (its growth interval, 2000, is never reached)."""
    scale, tracker = INIT_SCALE, 0
    for r in records:
        if r["disposition"] == "SKIPPED_NONFINITE":
            scale, tracker = scale * 0.5, 0
        elif r["disposition"] == "COMMITTED":
            tracker += 1
    return scale, tracker


def test_the_loss_scale_had_changed_when_the_process_was_killed(runs) -> None:
    name, parts = runs["at_kill"]
    window = int(name.split("-")[1])
    assert FAIL_WINDOW < window < STEPS
    records = ledger(runs["straight"])[:window]
    skips = [r["window"] for r in records if r["disposition"] == "SKIPPED_NONFINITE"]
    assert 0 in skips and FAIL_WINDOW in skips  # natural overflow first, then the fault
    scaler = parts["scaler"]["scaler"]
    assert (scaler["scale"], scaler["_growth_tracker"]) == closed_form_scaler(records)
    assert scaler["scale"] < INIT_SCALE / 2


def test_killed_and_resumed_fp16_run_is_bitwise_identical(runs) -> None:
    a, b = final_state(runs["straight"]), final_state(runs["killed"])
    assert {"model", "optimizer", "scheduler", "scaler", "counters", "rng", "data"} <= set(a)
    assert bitwise_differences(a, b) == []
    assert (runs["straight"] / "ledger.jsonl").read_bytes() == (
        runs["killed"] / "ledger.jsonl").read_bytes()
    scaler = a["scaler"]["scaler"]
    assert (scaler["scale"], scaler["_growth_tracker"]) == closed_form_scaler(ledger(runs["straight"]))
    assert a["scaler"]["precision"] == "fp16"


def test_negative_control_resume_without_scaler_state_differs(runs) -> None:
    a, c = final_state(runs["straight"]), final_state(runs["dropped"])
    differences = bitwise_differences(a, c)
    assert "scaler.scaler.scale" in differences, differences[:10]
    assert any(d.startswith("model.") for d in differences), differences[:10]
    # it restarted at 2^24 and overflowed again: the ledgers part where it resumed
    assert ledger(runs["dropped"]) != ledger(runs["straight"])
