"""SIGTERM to one rank only, off the checkpoint cadence (D1, D2, S3, S5, X4).

A scheduler (or a user) may signal a single worker of ``exactstep train --nproc 2``.
That rank sets its stop flag; ``parallel.agreement.agreed_stop`` all-reduces the flags
after every window, so both ranks stop after the same window, publish one checkpoint
there together and exit: the command ends with status 130 and one ``error:`` line,
``checkpoints/LATEST`` names that window (3, between the cadence's 2 and 4), and
``exactstep resume --nproc 2`` ends bitwise where the straight run ends (DCP model and
optimizer tensors, every rank's RNG and cursor, the common state, the ledger).

The signal reaches rank 1 from inside (a ``sitecustomize`` hook on ``PYTHONPATH``
sends SIGTERM to its own process when rank 1 starts window index 2), so it is the
same window on every machine. Negative controls: ``agreed_stop`` with the reducer
returns the agreed flag on both ranks while the local flags differ (two gloo
processes); and the same job with ``agreed_stop`` replaced by the local flag in the
workers does not end in a clean stop with a window-3 checkpoint (rank 1 stops and
publishes alone while rank 0 runs on: their collectives no longer line up).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import process_server
import pytest
from cli_support import LAUNCHER_VARS, CliRoot, tiny_overrides
from run_support import multi_rank_state as final_state

from exactstep.state import latest_checkpoint, verify_checkpoint
from exactstep.state.compare import state_differences

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WINDOWS, EVERY = 6, 2
SIGNAL_RANK, SIGNAL_WINDOW = 1, 2  # rank 1 is signalled as window index 2 starts
STOP = SIGNAL_WINDOW + 1  # the window count both ranks stop after: off the cadence
RUN_TIMEOUT_S = 200

HOOK = r"""
import os
if "RANK" in os.environ:  # a worker, not the launcher
    _signal = os.environ.get("EXACTSTEP_TEST_SIGNAL_AT")
    if _signal:
        import signal
        from exactstep.update.window import UpdateEngine
        _rank, _window = (int(x) for x in _signal.split(":"))
        _run_window = UpdateEngine.run_window
        def _probed(self, batches, window, *args, **kwargs):
            if window == _window and int(os.environ["RANK"]) == _rank:
                os.kill(os.getpid(), signal.SIGTERM)  # this rank only
            return _run_window(self, batches, window, *args, **kwargs)
        UpdateEngine.run_window = _probed
    if os.environ.get("EXACTSTEP_TEST_DEFECT") == "local_stop":
        import exactstep.run.runner
        exactstep.run.runner.agreed_stop = lambda requested, reducer: requested
"""


def overrides(corpus: Path) -> list[str]:
    return tiny_overrides(corpus, windows=WINDOWS, every=EVERY, seed=5, keep=5, extra={
        "parallel.timeout_s": 30,  # bounds the negative control's mismatched collectives
    })


class Cli(CliRoot):
    def __init__(self, root: Path) -> None:
        super().__init__(root, HOOK)

    def __call__(self, *args: str, signal_at: str = "", defect: str = ""
                 ) -> subprocess.CompletedProcess:
        env = self.env()
        if signal_at:
            env["EXACTSTEP_TEST_SIGNAL_AT"] = signal_at
        if defect:
            env["EXACTSTEP_TEST_DEFECT"] = defect
        return process_server.run([sys.executable, "-m", "exactstep", *args], cwd=self.root,
                                  env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)

    def train(self, run_dir: Path, **kw) -> subprocess.CompletedProcess:
        return self("train", "--nproc", "2", "--no-progress", "--out", str(run_dir),
                    *overrides(self.corpus), **kw)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]




@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("signal_one_rank")
    cli = Cli(root)
    done = cli.train(root / "straight")
    assert done.returncode == 0, done.stderr[-3000:]
    started = time.monotonic()
    stopped = cli.train(root / "stopped", signal_at=f"{SIGNAL_RANK}:{SIGNAL_WINDOW}")
    out = {"cli": cli, "root": root, "stopped": stopped,
           "seconds": time.monotonic() - started,
           "latest": latest_checkpoint(root / "stopped" / "checkpoints"),
           "ledger_lines": len((root / "stopped" / "ledger.jsonl").read_text().splitlines())}
    resumed = cli("resume", "--no-progress", str(root / "stopped"), "--nproc", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return out


def test_one_signalled_rank_stops_every_rank_on_the_same_window(runs) -> None:
    stopped = runs["stopped"]
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    lines = error_lines(stopped.stderr)
    assert len(lines) == 1, stopped.stderr[-3000:]
    assert f"after window {STOP}" in lines[0] and "exactstep resume" in lines[0], lines[0]
    assert STOP % EVERY != 0  # the stop is off the checkpoint cadence
    latest = runs["latest"]
    assert latest is not None and latest.name == f"window-{STOP:08d}"
    assert verify_checkpoint(latest).ok
    # both ranks saved their part of that one checkpoint, and wrote nothing later
    assert {p.name for p in latest.iterdir()} >= {"rank-00000.pt", "rank-00001.pt"}
    assert runs["ledger_lines"] == STOP


def test_the_resumed_run_ends_bitwise_where_the_straight_run_ends(runs) -> None:
    root = runs["root"]
    a, b = final_state(root / "straight"), final_state(root / "stopped")
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert any(k.startswith("state.") for k in a["optim"])  # keyed by parameter name
    assert state_differences(a, b) == []
    assert ((root / "stopped" / "ledger.jsonl").read_text()
            == (root / "straight" / "ledger.jsonl").read_text())


def test_negative_control_local_stop_flags_do_not_stop_together(runs) -> None:
    """The same signal with each rank deciding on its own flag: the job does not end
    in the clean stop above (130, one line, a verified window-3 checkpoint)."""
    cli, root = runs["cli"], runs["root"]
    done = cli.train(root / "local", signal_at=f"{SIGNAL_RANK}:{SIGNAL_WINDOW}",
                     defect="local_stop")
    latest = latest_checkpoint(root / "local" / "checkpoints")
    clean = (done.returncode == 130 and latest is not None
             and latest.name == f"window-{STOP:08d}" and verify_checkpoint(latest).ok)
    assert not clean, done.stderr[-3000:]


AGREE_WORKER = r"""
import sys
import torch.distributed as dist
from exactstep.parallel.agreement import agreed_stop
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2,
                        init_method=f"file://{sys.argv[2]}")
class Reducer:
    def max(self, t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t
requested = int(sys.argv[1]) == 1  # only rank 1 was signalled
print(int(agreed_stop(requested, Reducer())), int(agreed_stop(requested, None)))
dist.destroy_process_group()
"""


def test_agreed_stop_gives_every_rank_the_signalled_ranks_flag(tmp_path: Path) -> None:
    """Two gloo processes, rank 1's flag set: with the reducer both decide to stop;
    with the local flag (no reducer) they decide differently, which is what the
    agreement prevents."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE_WORKER)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    procs = [process_server.Popen([sys.executable, str(script), str(rank), str(tmp_path / "rdzv")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    agreed, local = zip(*(tuple(map(int, out.split())) for out, _ in outs), strict=True)
    assert agreed == (1, 1)
    assert local == (0, 1)
