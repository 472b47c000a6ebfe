"""SIGTERM mid-run: the current window finishes, a checkpoint is published, the process
exits non-zero with one line saying how to resume, and the resume finishes the run
with the same ledger as an uninterrupted one (S3, S4, X4)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import process_server
import pytest

from exactstep.state import latest_checkpoint, verify_checkpoint

STEPS = 40


def args(data: Path) -> list[str]:
    return [
        "--no-progress", "--set", f"data.source={data}", "--set", f"train.steps={STEPS}",
        "--set", "checkpoint.every=1000", "--set", "model.d_model=32", "--set", "model.n_layers=1",
        "--set", "model.n_heads=2", "--set", "model.d_ff=64", "--set", "batch.rows=2",
        "--set", "batch.seq_len=64", "--set", "train.eval_tokens=500", "--set", "train.device=cpu",
    ]


def write_data(path: Path) -> Path:
    lines = [json.dumps({"text": f"line {i} " * (3 + i % 11)}) for i in range(60)]
    path.write_text("\n".join(lines) + "\n")
    return path


def exactstep(*argv: str, **kw) -> subprocess.Popen:
    return process_server.Popen([sys.executable, "-m", "exactstep", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
@pytest.mark.thread_default  # its run sets no train.threads
@pytest.mark.timeout(300)
def test_sigterm_publishes_and_resume_completes(tmp_path) -> None:
    data = write_data(tmp_path / "docs.jsonl")
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    ref = exactstep("train", "--out", str(straight), *args(data))
    assert ref.wait(timeout=240) == 0, ref.stderr.read()

    proc = exactstep("train", "--out", str(stopped), *args(data))
    ledger = stopped / "ledger.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if ledger.exists() and len(ledger.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert lines[0].endswith(f"continue with: exactstep resume {stopped}, or the same train "
                             "command with --resume auto"), err
    assert "Traceback" not in err
    done = len(ledger.read_text().splitlines())
    assert done < STEPS  # it really stopped early
    latest = latest_checkpoint(stopped / "checkpoints")
    assert latest is not None and verify_checkpoint(latest).ok
    assert latest.name == f"window-{done:08d}"  # the checkpoint is at the last window logged

    resumed = exactstep("resume", str(stopped), "--no-progress")
    assert resumed.wait(timeout=240) == 0, resumed.stderr.read()
    assert ledger.read_text() == (straight / "ledger.jsonl").read_text()
