"""``exactstep prepare`` among other processes (P1, S8, X4).

- One process at a time on an output: while a ``prepare --out P`` runs, a second one
  into P is refused with one ``error:`` line naming the first one's PID and changes
  nothing beside P; the first publishes a P that verifies. Two at once used to leave
  a traceback and a P that ``train`` crashed on. Negative controls: once the first
  has exited, or was SIGKILLed, the same command is accepted.
- Its workers die with it: a SIGKILLed ``prepare --workers 2`` used to leave both
  spawn workers and multiprocessing's resource tracker running. Negative control: the
  same check on a plain spawn pool whose parent is killed finds them alive.

The first process is held at its first document (``hold_support``), so the second
surely runs while it is inside.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import process_server
import pytest
from hold_support import Held, descendants, error_lines, still_running
from run_support import short_texts, write_texts

from exactstep.cli import main
from exactstep.data.prepared import open_prepared
from exactstep.errors import DirectoryInUse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

QUIET = ["--no-progress", "--set", "data.val_fraction=0.2"]
# a few chunks of prepare's CHUNK_DOCUMENTS, so a pool of two gets work for both
MANY = 1200


def documents(prepared: Path) -> int:
    """Documents of a prepared directory that opens and verifies (every file's digest)."""
    return sum(split.documents for split in open_prepared(prepared).splits.values())


def listing(directory: Path) -> dict[str, tuple[str, ...]]:
    """Every entry of ``directory`` with, for a directory, the names inside it."""
    return {p.name: tuple(sorted(c.name for c in p.iterdir())) if p.is_dir() else ()
            for p in sorted(directory.iterdir())}


def test_a_prepare_in_progress_refuses_a_second_one_into_its_out(tmp_path, capfd):
    source = write_texts(tmp_path / "docs.jsonl", short_texts(MANY))
    out = tmp_path / "prepared"
    argv = ["prepare", str(source), "--out", str(out), *QUIET]
    first = Held.start(tmp_path, "prepare", argv)
    try:
        first.wait_reached()
        before = listing(tmp_path)
        capfd.readouterr()
        code = main(argv)
        err = capfd.readouterr().err
        assert code == DirectoryInUse.exit_code, err
        assert len(error_lines(err)) == 1 and f"process {first.pid}" in err, err
        assert "Traceback" not in err
        assert listing(tmp_path) == before  # nothing beside --out was touched
        code, _, err = first.release()
    finally:
        first.stop()
    assert code == 0, err
    assert documents(out) == MANY
    assert not any(p.name.startswith(".prepared") for p in tmp_path.iterdir())

    # negative control: with the first one gone, the lock no longer refuses (the
    # published --out is refused for what it holds instead)
    capfd.readouterr()
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "already exists" in err and "in use" not in err


def test_a_killed_prepare_blocks_no_rerun(tmp_path, capfd):
    source = write_texts(tmp_path / "docs.jsonl", short_texts(MANY))
    out = tmp_path / "prepared"
    argv = ["prepare", str(source), "--out", str(out), *QUIET]
    first = Held.start(tmp_path, "prepare", argv)
    try:
        first.wait_reached()
        first.kill()
    finally:
        first.stop()
    assert (tmp_path / ".prepared.partial").is_dir()  # what a SIGKILL leaves
    capfd.readouterr()
    assert main(argv) == 0, capfd.readouterr().err
    assert documents(out) == MANY
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "gate-held",
                                                           "hold_launcher.py", "prepared"]


def pool_processes(pid: int) -> list[int]:
    """``pid``'s descendants that multiprocessing started (workers, resource tracker)."""
    found = []
    for child in descendants(pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"multiprocessing" in command:
            found.append(child)
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_a_killed_prepare_takes_its_workers_with_it(tmp_path):
    source = write_texts(tmp_path / "docs.jsonl", short_texts(MANY))
    first = Held.start(tmp_path, "prepare", ["prepare", str(source), "--out",
                                             str(tmp_path / "prepared"), "--workers", "2",
                                             *QUIET])
    try:
        first.wait_reached()
        pool = pool_processes(first.pid)
        assert len(pool) >= 3, pool  # two workers and the resource tracker
        first.kill()
    finally:
        first.stop()
    left = still_running(pool, within_s=30)
    kill_all(left)  # should there be any, they are this test's own
    assert left == []


ORPHANING = r"""
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

if __name__ == "__main__":
    pool = ProcessPoolExecutor(2, mp_context=get_context("spawn"))
    futures = [pool.submit(time.sleep, 0.01) for _ in range(4)]
    for f in futures:
        f.result()
    open(sys.argv[1], "w").close()
    time.sleep(300)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_negative_control_a_plain_pool_outlives_its_killed_parent(tmp_path):
    script, ready = tmp_path / "orphaning.py", tmp_path / "ready"
    script.write_text(ORPHANING)
    proc = process_server.Popen([sys.executable, str(script), str(ready)])
    pool: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        pool = pool_processes(proc.pid)
        assert len(pool) >= 3, pool
        proc.kill()
        proc.wait(timeout=60)
        left = still_running(pool, within_s=3)
        assert left, "the check would not see an orphaned pool"
    finally:
        if proc.poll() is None:
            proc.kill()
        kill_all(pool)  # this test's own orphans, by PID


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
