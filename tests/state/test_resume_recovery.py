"""S8 recovery cases found from outside, each reproduced through the real CLI:

* a run SIGKILLed before its first checkpoint resumes from window 0 under the same
  manifest and ends exactly where an uninterrupted run ends;
* a full disk while a checkpoint is written (the OS's own EFBIG, from a file-size
  limit lowered inside the process) is one ``error:`` line naming the intact previous
  checkpoint, leaves no temporary directory, and the run then resumes exactly;
* the same while a journal line is appended (a torn line is left behind, then repaired);
* the ledger and metrics are checked against the checkpoint: a deleted middle line is
  refused, a torn tail after the last commit is repaired, and the metrics counters
  continue after a resume instead of restarting at 0.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import process_server
import pytest
from run_support import kill_when_ledger_has
from text_corpus import write_corpus

from exactstep.state import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

# Runs the CLI; with a window number N, lowers this process's file-size limit just
# before the Nth checkpoint save (kind "checkpoint") or after window N's ledger line
# (kind "ledger"), so the next write fails with the kernel's EFBIG.
LAUNCHER = r"""
import resource, sys
import exactstep.state.checkpointer as checkpointer
import exactstep.update.ledger as ledger_module
kind, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def limit(size):
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.RLIM_INFINITY))

if kind == "checkpoint":
    save, calls = checkpointer.Checkpointer.save, [0]
    def failing_save(self, *a, **k):
        calls[0] += 1
        if calls[0] == nth:
            limit(4096)
        return save(self, *a, **k)
    checkpointer.Checkpointer.save = failing_save
elif kind == "ledger":
    append = ledger_module.Ledger.append
    def failing_append(self, entry):
        append(self, entry)
        if self.position == nth:
            limit(self.path.stat().st_size + 40)
    ledger_module.Ledger.append = failing_append

from exactstep.cli import main
sys.exit(main(argv))
"""


def settings(corpus: Path, every: int) -> list[str]:
    pairs = ["seed=3", f"data.source={corpus}", "data.val_fraction=0.2", "batch.seq_len=32",
             "batch.rows=2", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
             "model.d_ff=32", "update.accum=2", "update.warmup=2", "train.steps=6",
             "train.eval_tokens=64", "train.threads=1", "train.device=cpu", "train.log_every=1",
             f"checkpoint.every={every}", "checkpoint.keep=3"]
    return ["--set", *pairs]


class Cli:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.corpus = root / "corpus.jsonl"
        write_corpus(self.corpus)
        self.launcher = root / "launch.py"
        self.launcher.write_text(LAUNCHER)

    def popen(self, args: list[str], kind: str = "none", nth: int = 0) -> subprocess.Popen:
        return process_server.Popen([sys.executable, str(self.launcher), kind, str(nth), *args],
                                    cwd=self.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def run(self, args: list[str], kind: str = "none", nth: int = 0) -> tuple[int, str]:
        proc = self.popen(args, kind, nth)
        _, err = proc.communicate(timeout=300)
        return proc.returncode, err.decode()

    def train(self, run_dir: Path, every: int, **kw) -> tuple[int, str]:
        return self.run(["train", "--no-progress", "--out", str(run_dir),
                         *settings(self.corpus, every)], **kw)

    def resume(self, run_dir: Path, *extra: str) -> tuple[int, str]:
        # train.log_every is presentation, not in the manifest: pass it again
        return self.run(["resume", "--no-progress", str(run_dir), *extra,
                         "--set", "train.log_every=1"])


@pytest.fixture(scope="module")
def cli(tmp_path_factory) -> Cli:
    return Cli(tmp_path_factory.mktemp("recovery"))


@pytest.fixture(scope="module")
def straight(cli) -> dict[int, Path]:
    """Uninterrupted references, one per checkpoint cadence."""
    out = {}
    for every in (2, 100):
        run_dir = cli.root / f"straight-{every}"
        code, err = cli.train(run_dir, every)
        assert code == 0, err
        out[every] = run_dir
    return out


def final_files(run_dir: Path) -> dict:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None and verify_checkpoint(path).ok
    return json.loads((path / "manifest.json").read_bytes())["files"]


def assert_same_run(a: Path, b: Path) -> None:
    assert final_files(a) == final_files(b)  # every state file byte-identical (S5)
    assert (a / "ledger.jsonl").read_bytes() == (b / "ledger.jsonl").read_bytes()


def one_error_line(err: str) -> str:
    """Exactly one ``error:`` line (progress lines may precede it) and no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == 1, err
    return errors[0]


def test_run_killed_before_its_first_checkpoint_resumes_from_window_zero(cli, straight) -> None:
    run_dir = cli.root / "killed-early"
    proc = cli.popen(["train", "--no-progress", "--out", str(run_dir),
                      *settings(cli.corpus, 100)])
    kill_when_ledger_has(proc, run_dir, 3)
    assert not (run_dir / "checkpoints" / "LATEST").exists()
    code, err = cli.train(run_dir, 100)  # the same --out again: told to resume
    assert code == 2 and "exactstep resume" in one_error_line(err)
    code, err = cli.resume(run_dir)
    assert code == 0, err
    assert "no checkpoint was published yet; starting again from window 0" in err
    assert_same_run(straight[100], run_dir)


def test_disk_full_while_writing_a_checkpoint(cli, straight) -> None:
    run_dir = cli.root / "full-checkpoint"
    code, err = cli.train(run_dir, 2, kind="checkpoint", nth=2)
    line = one_error_line(err)
    assert code == 2
    assert "writing checkpoint window-00000004" in line and "File too large" in line
    assert "the previous checkpoint window-00000002 is intact" in line
    assert f"exactstep resume {run_dir}" in line
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["LATEST", "window-00000002"]
    assert verify_checkpoint(root / "window-00000002").ok
    code, err = cli.resume(run_dir)
    assert code == 0, err
    assert_same_run(straight[2], run_dir)


def test_disk_full_while_appending_the_journals(cli, straight) -> None:
    """The limit drops just above the ledger's size after window 3, so the next
    journal line (metrics, then the ledger) cannot be written whole."""
    run_dir = cli.root / "full-journal"
    code, err = cli.train(run_dir, 2, kind="ledger", nth=3)
    line = one_error_line(err)
    assert code == 2 and ".jsonl failed (File too large)" in line
    assert "checkpoint window-00000002 is intact" in line
    failed = Path(line.split("writing ", 1)[1].split(" failed", 1)[0])
    assert failed.parent == run_dir and not failed.read_bytes().endswith(b"\n")  # torn
    code, err = cli.resume(run_dir)
    assert code == 0, err
    assert_same_run(straight[2], run_dir)


def resumed_copy(cli, straight, name: str, edit) -> tuple[Path, int, str]:
    """A copy of the finished every-2 run, edited, then resumed from window 2."""
    run_dir = cli.root / name
    shutil.copytree(straight[2], run_dir)
    edit(run_dir)
    code, err = cli.resume(run_dir, "--from", str(run_dir / "checkpoints" / "window-00000002"))
    return run_dir, code, err


def test_ledger_that_lost_a_middle_line_is_refused(cli, straight) -> None:
    def delete_line_two(run_dir: Path) -> None:
        lines = (run_dir / "ledger.jsonl").read_bytes().splitlines(keepends=True)
        (run_dir / "ledger.jsonl").write_bytes(lines[0] + b"".join(lines[2:]))

    run_dir, code, err = resumed_copy(cli, straight, "ledger-hole", delete_line_two)
    line = one_error_line(err)
    assert code == 2 and "ledger.jsonl does not match checkpoint window-00000002" in line


def test_torn_tail_after_the_last_commit_is_repaired(cli, straight) -> None:
    def torn(run_dir: Path) -> None:
        with (run_dir / "ledger.jsonl").open("ab") as fh:
            fh.write(b'{"window":6,"disp')
        with (run_dir / "metrics.jsonl").open("ab") as fh:
            fh.write(b'{"win')

    run_dir, code, err = resumed_copy(cli, straight, "torn", torn)
    assert code == 0, err
    assert_same_run(straight[2], run_dir)


TIMINGS = ("elapsed_s", "tokens_per_s")


def comparable(run_dir: Path) -> list[dict]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def test_metrics_continue_after_a_resume(cli, straight) -> None:
    run_dir, code, err = resumed_copy(cli, straight, "metrics", lambda run_dir: None)
    assert code == 0, err
    expected = comparable(straight[2])
    assert [r["committed"] for r in expected] == [1, 2, 3, 4, 5, 6]
    assert comparable(run_dir) == expected


def test_metrics_comparison_catches_counters_that_restart(cli, straight) -> None:
    """Negative control: counters restarted at the resume point do not compare equal."""
    restarted = comparable(straight[2])
    for k, record in enumerate(restarted[2:], start=1):
        record["committed"] = k
    assert restarted != comparable(straight[2])
