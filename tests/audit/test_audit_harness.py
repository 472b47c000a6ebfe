"""The audit's harness around a misbehaving target, through the command line (A1, X4):
a target's ``sys.exit`` and its own ``KeyboardInterrupt`` are a probe's ERROR and the
exit status stays the audit's; a hung probe stops at ``--probe-timeout``; under
``--json`` stdout is exactly one JSON object whatever the target prints; the user's
Ctrl-C still stops the audit with 130 and one line.

Each target is the nanoGPT-style example loop (which passes every probe) with one
method broken, written to ``tmp_path`` and run as ``python:loops:CLASS``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import process_server
import pytest

from exactstep.cli import main

pytestmark = pytest.mark.slow  # processes started and killed: out of the edit loop

LOOPS = '''
import os, sys, time
from pathlib import Path
from exactstep.audit.examples.nanogpt import NanoGPTLoop

class Exits(NanoGPTLoop):
    def train(self, microbatches):
        sys.exit(0)

class Interrupts(NanoGPTLoop):
    def train(self, microbatches):
        raise KeyboardInterrupt

class Spins(NanoGPTLoop):
    def train(self, microbatches):
        while True:
            pass

class Sleeps(NanoGPTLoop):
    def train(self, microbatches):
        Path("started").touch()
        time.sleep(1000)

class Prints(NanoGPTLoop):
    def build(self, spec):
        print("print in build")
        os.write(1, b"fd write in build\\n")
        return super().build(spec)

    def train(self, microbatches):
        print("print in train")
        os.write(1, b"fd write in train\\n")
        return super().train(microbatches)
'''

# shift calls train(); causal_attention only build() and logits()
PROBES = ["--probe", "shift", "--probe", "causal_attention"]


@pytest.fixture
def loops(tmp_path: Path) -> Path:
    (tmp_path / "loops.py").write_text(LOOPS, encoding="utf-8")
    return tmp_path


def environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def audit(cwd: Path, target: str, *args: str) -> subprocess.CompletedProcess:
    return process_server.run([sys.executable, "-m", "exactstep", "audit", "--target",
                           f"python:loops:{target}", *args], cwd=cwd, env=environment(),
                              capture_output=True, text=True, timeout=300)


def rows(out: str) -> dict[str, str]:
    """probe -> its table line."""
    return {line.split()[0]: line for line in out.splitlines()
            if line.split() and line.split()[0] in ("shift", "causal_attention")}


def test_sys_exit_in_train_is_an_error_and_exit_1(loops) -> None:
    done = audit(loops, "Exits", *PROBES)
    assert done.returncode == 1, done.stdout + done.stderr  # the target's 0 is not ours
    found = rows(done.stdout)
    assert found["shift"].endswith("ERROR")
    assert "the target raised SystemExit(0)" in found["shift"]
    assert found["causal_attention"].endswith("PASS")  # the audit went on
    assert done.stdout.strip().endswith("NOT CONFORMANT")


def test_the_targets_keyboard_interrupt_is_an_error_and_exit_1(loops) -> None:
    done = audit(loops, "Interrupts", *PROBES, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    probes = {p["probe"]: p for p in json.loads(done.stdout)["probes"]}
    assert probes["shift"]["status"] == "ERROR"
    assert probes["shift"]["observed"] == "the target raised KeyboardInterrupt"
    assert probes["causal_attention"]["status"] == "PASS"


@pytest.mark.parametrize("target", ["Spins", "Sleeps"])
def test_a_hung_train_stops_at_the_probe_timeout(loops, target) -> None:
    started = time.monotonic()
    done = audit(loops, target, *PROBES, "--probe-timeout", "3", "--json")
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    probes = {p["probe"]: p for p in report["probes"]}
    assert probes["shift"]["status"] == "ERROR"
    assert probes["shift"]["observed"] == "did not finish in 3 s"
    assert 3.0 <= probes["shift"]["seconds"] < 10.0
    assert probes["causal_attention"]["status"] == "PASS"  # rebuilt, and ran
    assert elapsed < 120  # import, 3 s, one tiny probe: bounded, not 1000 s


def test_json_stdout_is_one_object_whatever_the_target_prints(loops) -> None:
    """Also the negative control of the tests above: the loop with nothing broken but
    its prints passes both probes, exit 0, within a short timeout."""
    done = audit(loops, "Prints", *PROBES, "--json", "--probe-timeout", "60")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)  # nothing before or after the object
    assert report["ok"] is True
    assert [p["status"] for p in report["probes"]] == ["PASS", "PASS"]
    for text in ("print in build", "fd write in build", "print in train",
                 "fd write in train"):
        assert text in done.stderr and text not in done.stdout


def test_negative_control_without_the_redirect_stdout_is_not_json(loops) -> None:
    """The library call alone (no redirect) lets the prints reach stdout first: the
    check above would see it."""
    code = ("from exactstep.audit.run import audit; from exactstep.audit.render import "
            "format_json; print(format_json(audit('python:loops:Prints', ['shift'])))")
    done = process_server.run([sys.executable, "-c", code], cwd=loops, env=environment(),
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fd write in build" in done.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(done.stdout)


def test_the_users_ctrl_c_stops_the_audit_with_130_and_one_line(loops) -> None:
    process = process_server.Popen([sys.executable, "-m", "exactstep", "audit", "--target",
                                "python:loops:Sleeps", "--probe", "shift", "--probe",
                                "causal_attention"], cwd=loops, env=environment(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (loops / "started").exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130
    assert out == ""  # no table: the audit stopped
    assert err.strip().splitlines() == ["error: interrupted"]


def test_a_negative_probe_timeout_is_refused(capsys) -> None:
    assert main(["audit", "--target", "exactstep", "--probe-timeout", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--probe-timeout expects seconds >= 0" in err
