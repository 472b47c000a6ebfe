"""Every "continue with" hint names both ways to continue a run (S4, S10, X4).

After Ctrl-C or SIGTERM (``run.runner.resume_command``), a dead or stalled rank and a
signal before the workers reported (``parallel.launch.resume_hint``), and a full
disk (``state.checkpointer``), the one error line names ``exactstep resume RUN`` and
the same ``train`` command with ``--resume auto`` (what a launcher's restart or a
requeued job runs), and stays one line.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from exactstep.errors import RESUME_AUTO_HINT, StorageError
from exactstep.parallel import launch
from exactstep.run.runner import resume_command
from exactstep.state.checkpointer import Checkpointer

ARGV = ["train", "--out", "runs/x"]


def test_the_hint_names_the_train_command_with_resume_auto() -> None:
    assert "--resume auto" in RESUME_AUTO_HINT and "train" in RESUME_AUTO_HINT
    assert "\n" not in RESUME_AUTO_HINT


@pytest.mark.parametrize(("world", "flags"), [(1, ""), (2, " --nproc 2")])
def test_the_interrupted_hint_names_resume_and_resume_auto(world: int, flags: str) -> None:
    run = SimpleNamespace(out_dir=Path("runs/x"), ctx=SimpleNamespace(world_size=world))
    assert resume_command(run) == f"exactstep resume runs/x{flags}, {RESUME_AUTO_HINT}"


def test_the_launcher_hints_name_resume_auto_on_one_and_many_nodes() -> None:
    assert launch.resume_hint(ARGV, 2, None) == (
        f"'exactstep resume runs/x --nproc 2', {RESUME_AUTO_HINT}")
    nodes = launch.Nodes(nnodes=2, node_rank=1, endpoint="10.0.0.1:29500")
    line = launch.resume_hint(ARGV, 4, nodes)
    assert line.startswith("'exactstep resume runs/x --nproc 4 --nnodes 2 --node-rank 1 ")
    assert line.endswith(f"{RESUME_AUTO_HINT} on every node") and "\n" not in line


def test_a_dead_rank_and_a_signal_before_the_workers_reported_name_resume_auto(
        tmp_path, capsys) -> None:
    dead = SimpleNamespace(exitcode=-9, message="Signal 9 (SIGKILL) received by PID 4242",
                           timestamp=100)
    line = launch.failure_line(1, dead, {1: dead}, None, ARGV, 2)
    assert line.startswith("error: rank 1 of 2 died") and "\n" not in line
    assert "'exactstep resume runs/x --nproc 2'" in line and "--resume auto" in line
    assert launch.report_signal(signal.SIGTERM, tmp_path, ARGV, 2) == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "--resume auto" in lines[0]


def test_a_failed_checkpoint_write_names_resume_auto(tmp_path) -> None:
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep=1, model=None, engine=None,
                                stream=None, ctx=SimpleNamespace(distributed=False),
                                manifest_digest="0" * 64)
    with pytest.raises(StorageError) as info, checkpointer.guard_writes():
        raise OSError(28, "No space left on device", str(tmp_path / "ledger.jsonl"))
    message = str(info.value)
    assert f"continue with: exactstep resume {tmp_path}, {RESUME_AUTO_HINT}" in message
    assert "\n" not in message
