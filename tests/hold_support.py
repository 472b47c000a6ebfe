"""Real ``exactstep`` processes held at a named moment, for tests of what a second
process (or a SIGKILL) may do meanwhile.

``Held.start(root, moment, argv)`` runs ``python -m exactstep <argv>`` through a small
launcher that stops the process at ``moment`` until the test releases it:

    window:N   at the start of window N (``UpdateEngine.run_window``)
    prepare    when ``prepare`` writes its first document (its pool is up by then)
    export     before the export's handoff check (its temporary directory is written)

The launcher writes ``reached`` (holding its PID) into the test's gate directory when
it gets there and waits, at most ``HOLD_S`` seconds, for ``release``. Helpers find a
process's descendants through Linux's ``/proc`` and tell whether a PID still runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import process_server

HOLD_S = 240  # a held process gives up waiting after this (a test that hangs still ends)
START_S = 240  # how long a test waits for the process to reach its moment

LAUNCHER = r"""
import os, sys, time
from pathlib import Path

if __name__ == "__main__":  # a spawned worker imports this file again
    moment, gate, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]

    def hold():
        (gate / "reached").write_text(str(os.getpid()))
        deadline = time.monotonic() + HOLD_S
        while not (gate / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def held(original, when):
        def wrapper(*args, **kwargs):
            if when(*args, **kwargs) and not (gate / "reached").exists():
                hold()
            return original(*args, **kwargs)
        return wrapper

    if moment.startswith("window:"):
        from exactstep.update.window import UpdateEngine
        at = int(moment.split(":")[1])
        UpdateEngine.run_window = held(UpdateEngine.run_window,
                                       lambda self, batches, window, *a, **k: window == at)
    elif moment == "prepare":
        import exactstep.artifacts.prepare as prepare
        prepare.SplitWriter.add = held(prepare.SplitWriter.add, lambda *a, **k: True)
    elif moment == "export":
        import exactstep.artifacts.export as export
        export.handoff_check = held(export.handoff_check, lambda *a, **k: True)

    from exactstep.cli import main
    sys.exit(main(argv))
""".replace("HOLD_S", str(HOLD_S))


class Held:
    """One ``exactstep`` process held at a moment (see the module doc)."""

    def __init__(self, proc: subprocess.Popen, gate: Path) -> None:
        self.proc, self.gate = proc, gate

    @classmethod
    def start(cls, root: Path, moment: str, argv: Sequence[str], *, name: str = "held") -> Held:
        gate = root / f"gate-{name}"
        gate.mkdir()
        launcher = root / "hold_launcher.py"
        if not launcher.exists():
            launcher.write_text(LAUNCHER)
        proc = process_server.Popen([sys.executable, str(launcher), moment, str(gate), *argv],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return cls(proc, gate)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_reached(self) -> None:
        deadline = time.monotonic() + START_S
        while not (self.gate / "reached").exists():
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(f"exited {self.proc.returncode} before its moment:\n"
                                     f"{out}\n{err}")
            assert time.monotonic() < deadline, "never reached its moment"
            time.sleep(0.02)

    def release(self) -> tuple[int, str, str]:
        """Let it go on; its exit status, stdout and stderr."""
        (self.gate / "release").write_text("")
        out, err = self.proc.communicate(timeout=START_S)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        """SIGKILL it (no clean-up of any kind runs) and reap it. Its output is not
        read: a child it left running may hold the pipes open."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        for pipe in (self.proc.stdout, self.proc.stderr):
            pipe.close()

    def stop(self) -> None:
        """For a ``finally``: a process still running is killed."""
        if self.proc.poll() is None:
            self.kill()


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, theirs, ...), from Linux's /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            for child in children:
                if child not in found:
                    found.append(child)
                    todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a dead process not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def still_running(pids: Sequence[int], within_s: float) -> list[int]:
    """The ``pids`` still running after waiting up to ``within_s`` seconds for them to end
    (a generous bound: the point is that they end, not how fast)."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)
