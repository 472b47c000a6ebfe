"""One process at a time on a run directory (S8, X4): while ``train`` or ``resume``
works on RUN, a second ``resume RUN`` or ``train --out RUN`` is refused with one
``error:`` line naming the holder's PID, before it touches anything; the lock goes
with its holder, so a run whose process was SIGKILLed resumes at once.

Two resumes of one killed run used to both proceed: both appended to the ledger (55
to 75 lines for 40 windows) and every later resume was refused. Here the holder is a
real process held at a window (``hold_support``), so the second command surely runs
while the first is inside the run. Negative controls: once the holder has exited (or
was killed) the same command is accepted; a job's own ranks do not lock each other
out (``tests/parallel``).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import process_server
import pytest
from hold_support import Held, error_lines
from run_support import ledger, tree_digests
from text_corpus import write_corpus

from exactstep.cli import main
from exactstep.errors import DirectoryInUse
from exactstep.state.durable import LOCK_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WINDOWS = 6


def settings(corpus: Path) -> list[str]:
    pairs = {"seed": 3, "data.source": corpus, "data.val_fraction": 0.2, "batch.seq_len": 32,
             "batch.rows": 2, "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2,
             "model.d_ff": 32, "update.accum": 2, "update.warmup": 2, "train.steps": WINDOWS,
             "train.eval_tokens": 64, "train.threads": 1, "train.device": "cpu",
             "checkpoint.every": 2, "checkpoint.keep": 2}
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def refused_naming(code: int, stderr: str, holder: Held) -> None:
    lines = error_lines(stderr)
    assert code == DirectoryInUse.exit_code, stderr
    assert len(lines) == 1, stderr
    assert f"process {holder.pid}" in lines[0], lines[0]
    assert "Traceback" not in stderr


def test_a_run_in_use_is_refused_naming_its_holder_and_a_killed_holder_blocks_nothing(
        tmp_path, capfd):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    run = tmp_path / "run"
    train = ["train", "--no-progress", "--out", str(run), *settings(corpus)]
    resume = ["resume", "--no-progress", str(run)]

    first = Held.start(tmp_path, "window:3", train, name="train")
    try:
        first.wait_reached()  # windows 0-2 are in the ledger, checkpoint 2 is published
        before = tree_digests(run)
        for argv in (resume, train):
            capfd.readouterr()
            code = main(argv)
            refused_naming(code, capfd.readouterr().err, first)
            assert tree_digests(run) == before  # refused before touching anything
        first.kill()  # a SIGKILLed holder: its lock file stays, with its PID
    finally:
        first.stop()
    assert (run / LOCK_FILE).read_text().split() == [str(first.pid)]

    second = Held.start(tmp_path, "window:4", resume, name="resume")
    try:
        second.wait_reached()  # negative control: the killed holder did not block it
        capfd.readouterr()
        refused_naming(main(resume), capfd.readouterr().err, second)
        code, _, err = second.release()
    finally:
        second.stop()
    assert code == 0, err
    assert [r["window"] for r in ledger(run)] == list(range(WINDOWS))
    assert not (run / LOCK_FILE).exists()  # a clean exit takes its lock file away

    # negative control: with the holder gone, the same resume is accepted (nothing to do)
    capfd.readouterr()
    assert main(resume) == 0, capfd.readouterr().err
    assert [r["window"] for r in ledger(run)] == list(range(WINDOWS))


def test_two_resumes_of_a_killed_run_at_once_leave_one_ledger(tmp_path):
    """The reported race as it happened: two ``exactstep resume RUN`` started together
    on a run killed mid-way. Whichever order they run in, the ledger ends with one
    line per window and a later resume is accepted."""

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    run = tmp_path / "run"
    first = Held.start(tmp_path, "window:3",
                       ["train", "--no-progress", "--out", str(run), *settings(corpus)])
    first.wait_reached()
    first.kill()
    command = [sys.executable, "-m", "exactstep", "resume", "--no-progress", str(run)]

    def resume_once(_: int):
        return process_server.run(command, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(resume_once, range(2)))
    codes = sorted(d.returncode for d in done)
    assert codes in ([0, 0], [0, DirectoryInUse.exit_code]), [d.stderr for d in done]
    for d in done:
        if d.returncode:
            assert len(error_lines(d.stderr)) == 1 and "in use by process" in d.stderr
    assert [r["window"] for r in ledger(run)] == list(range(WINDOWS))
    later = process_server.run(command, capture_output=True, text=True, timeout=300)
    assert later.returncode == 0, later.stderr


def test_a_multi_process_job_is_refused_as_one_and_its_own_ranks_share_the_run(tmp_path):
    """Under ``--nproc 2`` rank 0 holds the run directory (the launcher holds nothing):
    a job started on a run in use ends with the one line rank 0 printed. Negative
    control: a job on a free run directory trains, its two ranks inside one lock."""

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    run = tmp_path / "run"
    first = Held.start(tmp_path, "window:3",
                       ["train", "--no-progress", "--out", str(run), *settings(corpus)])
    command = [sys.executable, "-m", "exactstep"]
    try:
        first.wait_reached()
        job = process_server.run([*command, "resume", "--no-progress", str(run), "--nproc", "2"],
                                 capture_output=True, text=True, timeout=300)
        refused_naming(job.returncode, job.stderr, first)
        code, _, err = first.release()
    finally:
        first.stop()
    assert code == 0, err

    other = tmp_path / "other"
    job = process_server.run([*command, "train", "--no-progress", "--out", str(other),
                          "--nproc", "2", *settings(corpus)],
                             capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    assert [r["window"] for r in ledger(other)] == list(range(WINDOWS))
    assert not (other / LOCK_FILE).exists()
