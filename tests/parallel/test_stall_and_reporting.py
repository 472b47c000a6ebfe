"""A stalled peer is bounded by parallel.timeout_s; a worker killed without a report is
described in one line (D1, X4; issue 16 items 3 and 4).

Spawned ranks over gloo: rank 1 stops answering (it sleeps inside a window, alive)
while rank 0 waits in the window's host agreement. Rank 0 must fail with one
``DistributedError`` within the bound. Negative control: the same job with the host
group created without a timeout (PyTorch's 30-minute default) keeps rank 0 waiting
for as long as the stall lasts. Through the command line (``--nproc 2``) the job ends
with one ``error:`` line naming the stalled rank.

The launcher's line for a worker killed by a signal is built from fabricated failure
records (torchrun's fields) and rank records: an NCCL watchdog abort (SIGABRT on an
NCCL rank) is named as such, with its rank and bound.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import process_server
import pytest
from cli_support import rank_window_hook, worker_env, write_hook
from run_support import TINY, set_args, short_texts, write_texts
from workers import rank_main, shards, spawn_ranks

from exactstep.parallel import launch
from exactstep.parallel.process_group import (
    DistContext,
    launcher_env,
    peer_failure,
    write_rank_record,
)

TIMEOUT_S = 5.0  # every group's bound, the rendezvous too: room for a loaded machine's start
SLACK_S = 2.0  # scheduling on a shared 2-core machine
STALL_S = 7.5  # past the bound plus the slack (rank 1 wakes earlier once rank 0 reported)
ARGV = ["train", "--out", "runs/x"]


# ------------------------------------------------------------- spawned ranks (gloo)


def stall_job(out: Path, **extra) -> tuple[list, list]:
    windows = shards([[[4, 4]] * 3, [[4, 4]] * 3])
    phase = {"windows": windows, "stall_at": (1, 1), "stall_s": STALL_S, "out": str(out)}
    job = {"phases": [phase], "timeout_s": TIMEOUT_S, **extra}
    results, codes, _ = spawn_ranks(rank_main, 2, out, job, deadline_s=60)
    return results, codes


def waited(out: Path, rank0: dict) -> float:
    """Seconds from rank 0 starting the stalled window to rank 0 ending."""
    return rank0["ended"] - float((out / "started0-1").read_text())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_stalled_peer_fails_the_waiting_rank_within_the_bound(tmp_path) -> None:
    results, codes = stall_job(tmp_path)
    rank0 = results[0]
    assert codes[0] is not None and rank0 is not None, "rank 0 hung"
    assert rank0.get("kind") == "PeerFailure", rank0
    assert f"no answer within {TIMEOUT_S:g} s (parallel.timeout_s)" in rank0["error"]
    assert "\n" not in rank0["error"]  # one line
    assert waited(tmp_path, rank0) <= TIMEOUT_S + SLACK_S


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_negative_control_a_host_group_without_the_timeout_waits_out_the_stall(tmp_path):
    results, _ = stall_job(tmp_path, host_group_without_timeout=True)
    rank0 = results[0]
    assert rank0 is not None and "error" not in rank0, rank0  # the stall simply ended
    assert waited(tmp_path, rank0) >= STALL_S > TIMEOUT_S + SLACK_S


# ------------------------------------------------------------- the command line

STALL_HOOK = rank_window_hook(
    "EXACTSTEP_TEST_STALL_AT",
    "signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stuck: a stop request cannot help",
    "time.sleep(120)", imports="signal, time")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_cli_job_with_a_stalled_rank_stops_with_one_error_line(tmp_path) -> None:
    hook = write_hook(tmp_path, STALL_HOOK)
    corpus = write_texts(tmp_path / "c.jsonl", short_texts())
    env = worker_env(hook)
    env["EXACTSTEP_TEST_STALL_AT"] = "1:1"
    settings = {**TINY, "data.source": corpus, "train.steps": 3, "train.eval_tokens": 64,
                "train.threads": 1, "update.warmup": 1, "checkpoint.every": 0,
                "parallel.timeout_s": TIMEOUT_S}
    start = time.monotonic()
    proc = process_server.run([sys.executable, "-m", "exactstep", "train", "--nproc", "2",
                           "--no-progress", "--out", str(tmp_path / "run"),
                           *set_args(settings)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    seconds = time.monotonic() - start
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: rank 1 of 2 stalled: rank 0 waited {TIMEOUT_S:g} s "
                               "(parallel.timeout_s)"), lines
    assert "Traceback" not in proc.stderr
    assert seconds < 90  # start-up of two workers + the bound, not the 120 s stall


# ------------------------------------------------------------- the launcher's line


def failure(exitcode: int, message, timestamp: int = 100) -> SimpleNamespace:
    """A torchrun ``ProcessFailure`` as the launcher sees it."""
    return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp)


def reported(rank: int, text: str, timestamp: int = 100) -> SimpleNamespace:
    """A failure whose worker wrote its error file (``report_failure``)."""
    return failure(2, {"message": f"rank {rank}: {text}", "extraInfo": {}}, timestamp)


def peer_echo(rank: int, cause: str, timestamp: int = 100) -> SimpleNamespace:
    """What a rank whose collective failed with ``cause`` records (the real message),
    in a job with ``parallel.timeout_s = 2``."""
    import torch

    ctx = DistContext(rank, 2, rank, torch.device("cpu"), "gloo", timeout_s=2.0)
    return reported(rank, str(peer_failure(ctx, RuntimeError(cause))), timestamp)


SIGNALLED = {6: "Signal 6 (SIGABRT) received by PID 4242",
             9: "Signal 9 (SIGKILL) received by PID 4242",
             15: "Signal 15 (SIGTERM) received by PID 4242"}
NCCL = {"rank": 1, "world_size": 2, "backend": "nccl", "device": "cuda:1", "timeout_s": 300.0}


def test_an_nccl_watchdog_abort_names_the_rank_nccl_and_the_bound() -> None:
    failures = {1: failure(-6, SIGNALLED[6])}
    line = launch.failure_line(1, failures[1], failures, NCCL, ARGV, 2)
    assert line.startswith("error: rank 1 of 2 was taken down by the NCCL watchdog (SIGABRT)")
    assert "within 300 s (parallel.timeout_s)" in line and "exactstep resume runs/x" in line
    assert "\n" not in line


def test_the_nccl_line_names_the_rank_that_was_still_running() -> None:
    """Ranks 0 and 1 aborted by their watchdogs; rank 2 never joined the collective and
    was stopped by the launcher: it is the one that stalled."""
    failures = {0: failure(-6, SIGNALLED[6], 100), 1: failure(-6, SIGNALLED[6], 100),
                2: failure(-15, SIGNALLED[15], 101)}
    rank, root = launch.root_cause(failures)
    line = launch.failure_line(rank, root, failures, {**NCCL, "rank": 0}, ARGV, 3)
    assert rank == 0 and "NCCL watchdog" in line
    assert "rank 2 was still running when the launcher stopped it" in line


@pytest.mark.parametrize("record,signum", [({**NCCL, "backend": "gloo"}, 6), (NCCL, 9), (None, 6)])
def test_negative_controls_other_deaths_are_not_called_nccl(record, signum) -> None:
    failures = {1: failure(-signum, SIGNALLED[signum])}
    line = launch.failure_line(1, failures[1], failures, record, ARGV, 2)
    assert "NCCL" not in line and line.startswith("error: rank 1 of 2 died (Signal")


def test_a_rank_stopped_after_its_peer_timed_out_is_named_stalled() -> None:
    echo = peer_echo(0, "[unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    failures = {0: echo, 1: failure(-15, SIGNALLED[15], timestamp=104)}
    rank, root = launch.root_cause(failures)
    assert rank == 1
    line = launch.failure_line(rank, root, failures, {**NCCL, "backend": "gloo"}, ARGV, 2)
    assert line.startswith("error: rank 1 of 2 stalled: rank 0 waited 2 s (parallel.timeout_s) "
                           "for it in a collective and gave up, then the launcher stopped "
                           "rank 1 (SIGTERM)")


def test_a_rank_stopped_in_the_second_its_peer_raised_is_not_the_cause() -> None:
    """Rank 1 raised its own error (a damaged shard); the launcher stopped rank 0 with
    SIGTERM within the same second (timestamps are whole seconds): the line is rank
    1's error, not "rank 0 died"."""
    failures = {0: failure(-15, SIGNALLED[15], timestamp=100),
                1: reported(1, "DataError: shard train-00001.tokens is damaged", 100)}
    rank, root = launch.root_cause(failures)
    assert rank == 1
    line = launch.failure_line(rank, root, failures, None, ARGV, 2)
    assert line.startswith("error: ") and "train-00001.tokens" in line


def test_a_refusal_every_rank_made_alike_is_said_once() -> None:
    """X4: rank 1 raised the same refusal as rank 0 a second earlier (timestamps are
    whole seconds); rank 0 printed it, so the launcher adds no second line. Control: a
    different error of rank 1 is still its line."""
    same = "ConfigError: parallel.tp = 2 does not shard LoRA adapters"
    failures = {0: reported(0, same, 101), 1: reported(1, same, 100)}
    rank, root = launch.root_cause(failures)
    assert rank == 1 and launch.failure_line(rank, root, failures, None, ARGV, 2) is None
    other = {0: reported(0, same, 101), 1: reported(1, "DataError: shard damaged", 100)}
    rank, root = launch.root_cause(other)
    assert launch.failure_line(rank, root, other, None, ARGV, 2) == (
        "error: rank 1: DataError: shard damaged")


def test_a_rank_killed_from_outside_is_still_the_cause_over_its_peers() -> None:
    """A SIGKILL from outside (no other rank raised its own error) stays the cause over
    the peers it made fail, even when they recorded their failure first."""
    failures = {0: peer_echo(0, "Connection closed by peer", timestamp=99),
                1: failure(-9, SIGNALLED[9], timestamp=100)}
    assert launch.root_cause(failures)[0] == 1


def test_negative_control_a_peer_that_died_is_not_called_stalled() -> None:
    failures = {0: peer_echo(0, "Connection closed by peer"), 1: failure(-9, SIGNALLED[9])}
    rank, root = launch.root_cause(failures)
    line = launch.failure_line(rank, root, failures, None, ARGV, 2)
    assert rank == 1 and line.startswith("error: rank 1 of 2 died (Signal 9 (SIGKILL)")


def test_rank_record_is_written_beside_the_error_file_and_read_back(tmp_path) -> None:
    folder = tmp_path / "exactstep-1_abc" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    import torch

    ctx = DistContext(1, 2, 1, torch.device("cpu"), "gloo", timeout_s=5.0)
    write_rank_record(ctx, {**launcher_env(1, 2, 1),
                            "TORCHELASTIC_ERROR_FILE": str(folder / "error.json")})
    assert launch.rank_record(tmp_path, 1) == {
        "rank": 1, "world_size": 2, "backend": "gloo", "device": "cpu", "timeout_s": 5.0,
        "layout": {"pp": 0, "dp": 1, "cp": 0, "tp": 0}}  # a context by hand: all replicas
    assert launch.rank_record(tmp_path, 0) is None
    write_rank_record(ctx, {})  # outside torchrun: nothing is written
    assert sorted(p.name for p in folder.iterdir()) == ["exactstep-rank.json"]


def test_report_child_failure_prints_the_nccl_line_once(tmp_path, capsys) -> None:
    folder = tmp_path / "run_1" / "attempt_0" / "1"
    folder.mkdir(parents=True)
    (folder / "exactstep-rank.json").write_text(json.dumps(NCCL))
    exc = SimpleNamespace(failures={1: failure(-6, SIGNALLED[6])})
    assert launch.report_child_failure(exc, ARGV, 2, tmp_path) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "NCCL watchdog" in err[0]


def torchrun_failure(tmp_path, rank: int, exitcode: int, exc=None):
    """torchrun's own ``ProcessFailure`` for worker ``rank`` that ended with ``exitcode``,
    after writing its error file for ``exc`` (``launch.write_error_file``) when given."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error-{rank}.json"
    if exc is not None:
        launch.write_error_file(str(path), rank, exc)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(path))


@pytest.mark.parametrize("stopped_rank", [0, 1])
def test_a_clean_stop_ends_130_when_the_launcher_also_signalled_a_reporting_rank(
        tmp_path, capsys, stopped_rank) -> None:
    """Both ranks report the agreed stop (Interrupted, 130); the first to exit makes the
    agent SIGTERM the other while it tears down, so that one ends by -15 (D2, X4). The
    job still ends 130 with rank 0's one line (it printed it itself): seen once in 30
    runs of the whole suite as exit 1 (rank 0 stopped). Control: the same
    failures without the exit code in the error file end 1 when rank 0 was the one
    stopped, so the recorded code is what gives 130."""
    from exactstep.errors import Interrupted

    stop = Interrupted("stopped by SIGTERM after window 3; a checkpoint was published")
    failures = {rank: torchrun_failure(tmp_path, rank, -15 if rank == stopped_rank else 130,
                                       stop) for rank in (0, 1)}
    assert launch.report_child_failure(SimpleNamespace(failures=failures), ARGV, 2) == 130
    assert capsys.readouterr().err == ""  # rank 0, the root cause, printed its own line
    for failure in failures.values():  # control: an error file without the code
        del failure.message["extraInfo"][launch.EXIT_CODE_KEY]
    expected = 1 if stopped_rank == 0 else 130  # rank 1 signalled: rank 0 exited 130
    assert launch.report_child_failure(SimpleNamespace(failures=failures), ARGV, 2) == expected


def test_a_worker_that_exited_with_its_own_code_keeps_it(tmp_path) -> None:
    from exactstep.errors import ConfigError

    failures = {0: torchrun_failure(tmp_path, 0, 2, ConfigError("bad")),
                1: torchrun_failure(tmp_path, 1, -9)}
    assert launch.exit_code_of(failures[0]) == 2
    assert launch.exit_code_of(failures[1]) == 1  # killed, no report: unknown


def test_checkpoint_barriers_and_dcp_run_on_the_host_group(monkeypatch) -> None:
    import torch

    from exactstep.parallel import dcp_format

    host = object()
    calls = []
    monkeypatch.setattr(dcp_format.dist, "barrier", lambda group=None: calls.append(group))
    ctx = DistContext(0, 2, 0, torch.device("cuda", 0), "nccl", host_group=host)
    dcp_format._barrier(ctx)
    assert calls == [host]
    assert dcp_format._group(ctx) is host
