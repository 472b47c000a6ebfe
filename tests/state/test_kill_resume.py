"""S5 exactness with real processes: N windows straight vs the same run SIGKILLed
at several moments (inside windows, inside checkpoint publication, after the last
checkpoint, and from outside at an arbitrary moment) and resumed with
``exactstep resume`` each time. Both must end with bitwise-identical model,
optimizer, schedule, scaler, RNG, data cursor and progress, and identical ledgers.

Negative controls: the same comparison run on a resume that drops the data cursor,
or the RNG state, must fail.

Each launch runs under the next of ``OMP_NUM_THREADS`` unset, ``1`` and ``2`` (the
caller's value is never used), so every lineage crosses thread defaults: a run
trained with ``train.threads=1`` resumes at its recorded count whatever the resuming
process's default (S9).

Every process runs through a small launcher (written into ``tmp_path``) that
(0) seeds every RNG stream from the run's seed when it starts a new run (the
streams otherwise start from OS entropy); (1) advances the Python, NumPy and torch RNG streams at the start of each window,
standing in for a stochastic layer such as dropout, so that RNG restoration is
observable; (2) optionally SIGKILLs its own process at a named moment; and
(3) optionally applies one deliberate resume defect.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import process_server
import pytest
from run_support import kill_once_ledger_has
from text_corpus import write_corpus, write_whole

from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

WINDOWS = 10
EVERY = 2

LAUNCHER = r"""
import os, random, signal, sys
import numpy as np
import torch
import exactstep.run.continuation as continuation
import exactstep.run.runner as runner
import exactstep.state.checkpointer as checkpointer
import exactstep.state.store as store
from exactstep.update.window import UpdateEngine

kill_at, defect, argv = sys.argv[1], sys.argv[2], sys.argv[3:]

if argv[0] == "train":
    # Python, NumPy and (in torch >= 2.13) torch start from OS entropy; a new run
    # seeds them all from its seed. Harmless if the runner seeds them too.
    from exactstep.state.rng import seed_rng
    seed_rng(int(next(a for a in argv if a.startswith("seed=")).split("=")[1]))

def die():
    os.kill(os.getpid(), signal.SIGKILL)

run_window = UpdateEngine.run_window

def probed_run_window(self, batches, window, *args, **kwargs):
    random.random(); np.random.random(); torch.rand(1)   # every stream advances
    if kill_at == f"window_start:{window}":
        die()
    result = run_window(self, batches, window, *args, **kwargs)
    if kill_at == f"window_end:{window}":   # update applied in memory, not logged
        die()
    return result

UpdateEngine.run_window = probed_run_window

if kill_at != "none" and not kill_at.startswith("window_"):
    name, nth = kill_at.split(":")
    modules = (runner, continuation) if name == "finish" else (store,)
    original, calls = getattr(modules[0], name), [0]
    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(nth):
            die()
        return original(*args, **kwargs)
    for module in modules:   # a new run finishes in runner, a resume in continuation
        setattr(module, name, counted)

if defect == "no_rng":
    checkpointer.restore_rng = lambda state: None
elif defect == "no_cursor":
    from exactstep.rows.stream import RowStream
    RowStream.load_state_dict = lambda self, state: None

from exactstep.cli import main
sys.exit(main(argv))
"""


def settings(corpus: Path) -> list[str]:
    pairs = {
        "seed": 3,
        "data.source": str(corpus),
        "data.val_fraction": 0.2,
        "batch.seq_len": 32,
        "batch.rows": 2,
        "model.d_model": 16,
        "model.n_layers": 1,
        "model.n_heads": 2,
        "model.d_ff": 32,
        "update.accum": 2,
        "update.warmup": 2,
        "train.steps": WINDOWS,
        "train.eval_tokens": 64,
        "train.threads": 1,
        "train.device": "cpu",  # bitwise resume is a CPU promise (S5)
        "checkpoint.every": EVERY,
        "checkpoint.keep": 2,
    }
    out: list[str] = []
    for key, value in pairs.items():
        out += ["--set", f"{key}={value}"]
    return out


#: The thread settings launches cycle through (None: the variable is unset).
OMP_SETTINGS = (None, "1", "2")


def omp_env(setting: str | None) -> dict[str, str]:
    """This process's environment with ``OMP_NUM_THREADS`` set to ``setting`` (or unset)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if setting is not None:
        env["OMP_NUM_THREADS"] = setting
    return env


class Harness:
    _settings = itertools.cycle(OMP_SETTINGS)
    _lock = threading.Lock()

    def __init__(self, root: Path) -> None:
        self.root = root
        self.launcher = root / "launch.py"
        write_whole(self.launcher, LAUNCHER)  # other threads may be launching it now
        self.corpus = root / "corpus.jsonl"
        write_corpus(self.corpus)

    def launch(
        self,
        command: list[str],
        *,
        kill_at: str = "none",
        defect: str = "none",
        kill_after_lines: int = 0,
        run_dir: Path,
        omp: str | None | bool = False,
    ) -> int:
        """Run one process; with ``kill_after_lines`` the parent SIGKILLs it as soon
        as the ledger holds that many lines. ``omp`` is its ``OMP_NUM_THREADS``
        (``None``: unset; by default the next of ``OMP_SETTINGS``). Returns the exit
        status."""
        args = [sys.executable, str(self.launcher), kill_at, defect, *command]
        with Harness._lock:
            setting = next(Harness._settings) if omp is False else omp
        proc = process_server.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.root,
            env=omp_env(setting),
        )
        if kill_after_lines:
            kill_once_ledger_has(proc, run_dir, kill_after_lines)
        output, _ = proc.communicate(timeout=300)
        self.last_output = output.decode(errors="replace")
        return proc.returncode

    def train(self, run_dir: Path, **kw) -> int:
        return self.launch(
            ["train", "--no-progress", "--out", str(run_dir), *settings(self.corpus)],
            run_dir=run_dir,
            **kw,
        )

    def resume(self, run_dir: Path, **kw) -> int:
        return self.launch(["resume", "--no-progress", str(run_dir)], run_dir=run_dir, **kw)


def final_state(run_dir: Path) -> tuple[str, dict]:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None
    model, parts = load_checkpoint(path)
    return path.name, {"model": model, **parts}


def ledger_lines(run_dir: Path) -> int:
    return (run_dir / "ledger.jsonl").read_bytes().count(b"\n")


def killed(status: int) -> bool:
    return status == -signal.SIGKILL


def run_straight(h: Harness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def run_killed_lineage(h: Harness, defective: ThreadPoolExecutor) -> tuple[Path, list[str], dict]:
    """One run, killed at five moments, resumed after each; returns the moments hit.

    After the first kill, two copies of the run directory are resumed on
    ``defective`` with one deliberate defect each (the negative controls)."""
    run_dir = h.root / "killed"
    moments = []
    assert killed(h.train(run_dir, kill_at="window_end:3")), h.last_output
    moments.append("inside window 3, after its update, before its ledger line")
    controls = {}
    for defect in ("no_cursor", "no_rng"):
        copy = h.root / defect
        shutil.copytree(run_dir, copy)
        controls[defect] = defective.submit(resume_with_defect, Harness(h.root), copy, defect)
    plan = [
        ("_seal:3", "while sealing (fsync + sha256) the 3rd file of a checkpoint"),
        ("point_latest:1", "after a checkpoint's rename, before LATEST moved"),
        ("external", "external SIGKILL once the ledger grew past every earlier line"),
        ("finish:1", "after the final checkpoint, before the summary"),
    ]
    high_water = ledger_lines(run_dir)
    for kill_at, moment in plan:
        latest = latest_checkpoint(run_dir / "checkpoints")
        assert latest is not None and verify_checkpoint(latest).ok  # S3 after every kill
        if kill_at == "external":
            status = h.resume(run_dir, kill_after_lines=high_water + 1)
        else:
            status = h.resume(run_dir, kill_at=kill_at)
        assert killed(status), f"{moment}: exit {status}\n{h.last_output}"
        moments.append(moment)
        high_water = max(high_water, ledger_lines(run_dir))
    assert h.resume(run_dir) == 0, h.last_output
    return run_dir, moments, {defect: f.result() for defect, f in controls.items()}


def resume_with_defect(h: Harness, run_dir: Path, defect: str) -> Path:
    assert h.resume(run_dir, defect=defect) == 0, h.last_output
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    h = Harness(tmp_path_factory.mktemp("s5"))
    with ThreadPoolExecutor(max_workers=2) as pool, ThreadPoolExecutor(max_workers=1) as other:
        straight = pool.submit(run_straight, Harness(h.root))
        lineage = pool.submit(run_killed_lineage, Harness(h.root), other)
        killed_dir, moments, defective = lineage.result()
        return straight.result(), (killed_dir, moments), defective


def test_killed_and_resumed_run_is_bitwise_identical(runs) -> None:
    straight, (killed_dir, moments), _ = runs
    assert len(moments) >= 5
    name_a, state_a = final_state(straight)
    name_b, state_b = final_state(killed_dir)
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    assert set(state_a) >= {"model", "optimizer", "scheduler", "scaler", "rng", "data", "progress"}
    assert "torch" in state_a["rng"]
    assert state_differences(state_a, state_b) == []
    assert (straight / "ledger.jsonl").read_bytes() == (killed_dir / "ledger.jsonl").read_bytes()
    assert ledger_lines(straight) == WINDOWS
    assert (straight / "manifest.json").read_bytes() == (killed_dir / "manifest.json").read_bytes()


def test_checkpoint_files_are_byte_identical(runs) -> None:
    """Stronger than state equality: the final checkpoint files hash the same."""
    straight, (killed_dir, _), _ = runs
    digests = []
    for run_dir in (straight, killed_dir):
        path = latest_checkpoint(run_dir / "checkpoints")
        digests.append(json.loads((path / "manifest.json").read_bytes())["files"])
    assert digests[0] == digests[1]


def test_no_uncommitted_leftovers_after_resumes(runs) -> None:
    _, (killed_dir, _), _ = runs
    names = sorted(p.name for p in (killed_dir / "checkpoints").iterdir())
    assert names == ["LATEST", f"window-{WINDOWS - EVERY:08d}", f"window-{WINDOWS:08d}"]


def test_resume_without_cursor_fails_comparison(runs) -> None:
    straight, _, defective = runs
    _, state_a = final_state(straight)
    _, state_b = final_state(defective["no_cursor"])
    differences = state_differences(state_a, state_b)
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)


def test_resume_without_rng_fails_comparison(runs) -> None:
    straight, _, defective = runs
    _, state_a = final_state(straight)
    _, state_b = final_state(defective["no_rng"])
    differences = state_differences(state_a, state_b)
    assert "rng.torch" in differences, differences[:20]
    assert any(d.startswith("rng.python.") for d in differences), differences[:20]
    assert all(d.startswith("rng.") for d in differences)
