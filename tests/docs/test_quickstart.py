"""The quickstart, run as written (X1, X3, S5, H3): its one runnable block, line by
line, in a fresh directory, with tiny settings added to the training run only.

``make train`` runs the Makefile's own ``train`` recipe (``exactstep train --out
$(OUT)``, read from the Makefile) with a tiny model and a short run, interrupted by
SIGINT (what Ctrl-C sends) after its first windows: it must stop non-zero with a
published checkpoint and the command that resumes. Every later line runs exactly as
the page prints it, and each must succeed: resume to the end (``summary.json``,
``loss.png``), eval, export, export verify. The finished run directory holds only
entries the run-directory reference describes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import process_server
import pytest
from docs_support import ROOT, command_lines, exactstep_argv, hook, runnable_blocks

TINY = ["--no-progress", "--set", "train.device=cpu", "model.d_model=32", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=64", "batch.rows=2", "batch.seq_len=64",
        "train.eval_tokens=2000", "update.warmup=2", "data.max_docs=200", "train.steps=60",
        "checkpoint.every=20"]


def make_train_argv() -> list[str]:
    """The Makefile's ``train`` recipe as exactstep argv (``$(OUT)`` at its default)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    out = re.search(r"^OUT \?= (\S+)", text, re.M).group(1)
    recipe = re.search(r"^train:.*\n\t(.+)", text, re.M).group(1)
    words = shlex.split(recipe.replace("$(OUT)", out))
    assert words[0].endswith("/exactstep"), recipe
    return words[1:]


def run(argv: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return process_server.run([sys.executable, "-m", "exactstep", *argv], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)


def interrupted_train(argv: list[str], cwd: Path, env: dict) -> tuple[int, str, Path]:
    """Start the training run, SIGINT it once its ledger holds 3 windows."""
    run_dir = cwd / argv[argv.index("--out") + 1]
    proc = process_server.Popen([sys.executable, "-m", "exactstep", *argv, *TINY], cwd=cwd,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    ledger = run_dir / "ledger.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if ledger.is_file() and len(ledger.read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, run_dir


@pytest.mark.slow
def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    (block,) = runnable_blocks(page)
    lines = command_lines(block)
    assert lines[0] == "make train"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    ran = []
    for line in lines:
        if line == "make train":
            code, err, run_dir = interrupted_train(make_train_argv(), tmp_path, env)
            assert code != 0, err
            assert "exactstep resume" in err, err[-2000:]
            assert (run_dir / "checkpoints" / "LATEST").is_file()
            assert not (run_dir / "summary.json").exists()  # stopped before the end
            ran.append("train (interrupted)")
            continue
        argv = exactstep_argv(line)
        if argv is None:
            assert line.startswith("source "), line  # the shell's PATH, nothing to run
            continue
        proc = run(argv, tmp_path, env)
        assert proc.returncode == 0, (line, proc.stderr[-3000:])
        ran.append(argv[0] + (" " + argv[1] if argv[1:2] == ["verify"] else ""))
        if argv[0] == "eval":
            assert "bits per byte" in proc.stdout + proc.stderr
    assert ran == ["train (interrupted)", "resume", "eval", "export", "export verify"]
    ledger = (run_dir / "ledger.jsonl").read_text().splitlines()
    assert len(ledger) == 60  # every window once: the interrupted part and the rest
    assert (run_dir / "summary.json").is_file() and (run_dir / "loss.png").is_file()
    described = set(hook().meanings()["run_directory"])
    entries = {p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()}
    assert entries - described == set()
    assert {"manifest.json", "ledger.jsonl", "metrics.jsonl", "loss.png", "summary.json",
            "data_report.json", "checkpoints/"} <= entries
