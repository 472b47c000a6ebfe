"""The lock primitives of ``exactstep.state.durable`` (S8, X4): one process at a time on a
directory, refused in one message naming the holder's PID; the kernel's ``flock``, so
a SIGKILLed holder blocks nothing; a refused start removes only what it created; a
killed process's temporary siblings are told from a running one's.

Holders run as separate processes (``HOLDER``: takes the lock, says so, waits for a
file), since the point is what a second process sees.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import process_server
import pytest

import exactstep.state.durable as durable
from exactstep.errors import DirectoryInUse, ExactstepError
from exactstep.state.durable import (
    LOCK_FILE,
    exclusive_lock,
    lock_beside,
    locked_directory,
    pid_running,
    stale_temporaries,
)

HOLDER = r"""
import sys, time
from pathlib import Path
from exactstep.state.durable import exclusive_lock
lock, ready, release = (Path(a) for a in sys.argv[1:4])
with exclusive_lock(lock, "the thing"):
    ready.write_text("")
    deadline = time.monotonic() + 120
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
"""


def hold(tmp_path: Path, lock: Path) -> tuple[subprocess.Popen, Path]:
    ready, release = tmp_path / "ready", tmp_path / "release"
    for flag in (ready, release):
        flag.unlink(missing_ok=True)
    proc = process_server.Popen([sys.executable, "-c", HOLDER, str(lock), str(ready), str(release)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the holder never held"
        time.sleep(0.01)
    return proc, release


def test_a_held_lock_refuses_a_second_process_naming_the_holder(tmp_path):
    lock = tmp_path / "x.lock"
    holder, release = hold(tmp_path, lock)
    try:
        assert lock.read_text().split() == [str(holder.pid)]
        with pytest.raises(DirectoryInUse) as refused, exclusive_lock(lock, "--out x"):
            pytest.fail("the block ran while another process held the lock")
        message = str(refused.value)
        assert message.startswith("--out x is in use by process ")
        assert f"process {holder.pid} " in message and "\n" not in message
        assert refused.value.exit_code == 75 and isinstance(refused.value, ExactstepError)
        assert lock.read_text().split() == [str(holder.pid)]  # the refused one wrote nothing
    finally:
        release.write_text("")
        holder.wait(timeout=60)
    assert not lock.exists()  # a clean release removes the lock file
    # negative control: with the holder gone the same lock is taken
    with exclusive_lock(lock, "--out x"):
        assert lock.read_text().split() == [str(os.getpid())]


def test_a_killed_holder_leaves_a_file_that_holds_no_lock(tmp_path):
    lock = tmp_path / "x.lock"
    holder, _ = hold(tmp_path, lock)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    assert lock.read_text().split() == [str(holder.pid)]  # left behind, with a dead PID
    with exclusive_lock(lock, "--out x"):
        assert lock.read_text().split() == [str(os.getpid())]
    assert not lock.exists()


def test_a_lock_file_removed_while_waited_on_is_not_trusted(tmp_path, monkeypatch):
    """A holder removes its file on release; a process that opened the old file just
    before must lock the file now at that path, not the removed one (else two processes
    could each hold "the" lock). Negative control: without the check it would lock the
    removed file."""
    lock = tmp_path / "x.lock"
    real_open, opened = os.open, []

    def open_then_replaced(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        if Path(path) == lock and not opened:  # the first open: its file is replaced
            opened.append(os.fstat(fd).st_ino)
            os.unlink(lock)
            lock.write_text("")
        return fd

    monkeypatch.setattr(durable.os, "open", open_then_replaced)
    fd = durable.acquire_lock(lock, "x")
    try:
        assert os.fstat(fd).st_ino == lock.stat().st_ino != opened[0]
    finally:
        durable.release_lock(fd, lock)
    monkeypatch.setattr(durable, "_names", lambda fd, path: True)
    opened.clear()
    fd = durable.acquire_lock(lock, "x")
    assert os.fstat(fd).st_ino == opened[0] != lock.stat().st_ino  # the removed file
    os.close(fd)


def test_a_file_system_without_locks_runs_unlocked_with_one_warning(tmp_path, monkeypatch,
                                                                   capsys):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with exclusive_lock(tmp_path / "x.lock", "--out x"):
        pass
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "warning: --out x cannot be locked (No locks available)" in err[0]


def test_a_lock_beside_an_output_and_the_directories_it_made(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    assert lock_beside(out) == tmp_path / "a" / "b" / ".out.lock"
    with exclusive_lock(lock_beside(out), "--out"):
        assert (tmp_path / "a" / "b").is_dir()
    assert not (tmp_path / "a").exists()  # nothing was published: nothing is left
    with exclusive_lock(lock_beside(out), "--out"):
        out.mkdir()
    assert out.is_dir() and not lock_beside(out).exists()  # a published output stays


class Refused(Exception):
    pass


def test_a_refused_start_removes_only_what_it_created(tmp_path):
    new = tmp_path / "p" / "run"
    with pytest.raises(Refused), locked_directory(new, "--out", committed="manifest.json"):
        assert (new / LOCK_FILE).is_file()
        (new / "wandb").mkdir()
        (new / "wandb" / "log").write_text("offline run")
        raise Refused
    assert not (tmp_path / "p").exists()  # the directory and the parent it made

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "mine.txt").write_text("the user's")
    with pytest.raises(Refused), locked_directory(existing, "--out", committed="manifest.json"):
        (existing / "tensorboard").mkdir()
        raise Refused
    assert sorted(p.name for p in existing.iterdir()) == ["mine.txt"]


def test_negative_control_a_committed_or_finished_directory_is_kept(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(Refused), locked_directory(run, "--out", committed="manifest.json"):
        (run / "manifest.json").write_text("{}")
        (run / "wandb").mkdir()
        raise Refused
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json", "wandb"]

    other = tmp_path / "other"
    with locked_directory(other, "--out", committed="manifest.json"):
        (other / "wandb").mkdir()
    assert sorted(p.name for p in other.iterdir()) == ["wandb"]

    kept = tmp_path / "kept"  # no ``committed`` name (a resume): nothing is removed
    with pytest.raises(Refused), locked_directory(kept, "run directory"):
        (kept / "wandb").mkdir()
        raise Refused
    assert sorted(p.name for p in kept.iterdir()) == ["wandb"]


def test_only_a_killed_process_temporaries_are_stale(tmp_path):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(timeout=60)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        out = tmp_path / "out"
        names = {f".out.tmp-{ended.pid}": True, f".out.tmp-{running.pid}": False,
                 f".out.tmp-{os.getpid()}": False, f".other.tmp-{ended.pid}": False,
                 ".out.tmp-x": False, f"out.tmp-{ended.pid}": False}
        for name in names:
            (tmp_path / name).mkdir()
        assert not pid_running(ended.pid) and pid_running(running.pid)
        assert stale_temporaries(out) == [tmp_path / n for n, stale in names.items() if stale]
        assert stale_temporaries(tmp_path / "absent" / "out") == []
    finally:
        running.kill()
        running.wait(timeout=60)
