"""``exactstep train --resume auto``: restarts and requeues continue exactly (S10, S4, S5, S8).

The same ``train`` command, run again on its run directory, must end bitwise equal
to a straight run: (a) under ``torchrun --max-restarts 1`` with rank 1 SIGKILLed once
at the start of window 3 (the agent restarts both workers, which resume from
``window-00000002``); (b) through a requeue, one process, the command killed at
window 3 and run again unchanged; (d) a first attempt killed at window 1, before any
checkpoint, leaves a manifest only, and the rerun starts again from window 0.
(c) A changed configuration is refused in one ``error:`` line naming the field,
the run directory byte-identical afterwards; so is the plain ``train`` without
``--resume auto`` (the control: the flag is what lets the same command continue).

The kill reaches a worker through a ``sitecustomize`` hook on ``PYTHONPATH`` that
SIGKILLs the named rank at the named window once (a marker file records that it
fired), so the restarted workers and the rerun command carry the same environment.
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import process_server
import pytest
from cli_support import KILL_ONCE_HOOK, CliRoot, tiny_overrides, worker_env
from run_support import multi_rank_state, tree_digests

from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WINDOWS = 6
EVERY = 2
RUN_TIMEOUT_S = 150  # every command is bounded; a hang fails the test instead


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "--max-restarts", "1", "-m", "exactstep")


def settings(corpus: Path, **changed: object) -> list[str]:
    return tiny_overrides(corpus, windows=WINDOWS, every=EVERY,
                          extra={k.replace("__", "."): v for k, v in changed.items()})


class Cli(CliRoot):
    def __init__(self, root: Path) -> None:
        super().__init__(root, KILL_ONCE_HOOK)

    def train(self, run_dir: Path, *extra: str, launcher: tuple[str, ...] | None = None,
              kill_once: str = "", auto: bool = True, **changed: object
              ) -> tuple[int, str]:
        """``train --out run_dir [--resume auto] ...`` (``python -m exactstep`` unless
        ``launcher``); ``kill_once`` is ``RANK:WINDOW``, fired once per ``run_dir``."""
        env = worker_env(self.hook, drop_prefix="TORCHELASTIC_")
        if kill_once:
            env["EXACTSTEP_TEST_KILL_ONCE"] = f"{kill_once}:{run_dir}.killed"
        command = [*(launcher or (sys.executable, "-m", "exactstep")), "train",
                   "--no-progress", "--out", str(run_dir), *(("--resume", "auto") * auto),
                   *extra, *settings(self.corpus, **changed)]
        proc = process_server.run(command, cwd=self.root, env=env, capture_output=True,
                                  text=True, timeout=RUN_TIMEOUT_S)
        return proc.returncode, proc.stderr


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def said(stderr: str, text: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("exactstep:")
            and text in line]


def one_process_state(run_dir: Path) -> tuple[str, dict]:
    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None
    model, parts = load_checkpoint(path)
    return path.name, {"model": model, **parts}


def committed(run_dir: Path) -> dict[str, str]:
    """Every file's digest but the lock file, which the killed attempt left behind (it
    holds no lock: ``flock`` ends with its holder) and the next command removes."""
    return {k: v for k, v in tree_digests(run_dir).items() if k != ".exactstep.lock"}


def ledger_text(run_dir: Path) -> list[str]:
    return (run_dir / "ledger.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("resume_auto")
    cli = Cli(root)
    out: dict = {"cli": cli, "root": root}
    # references: --resume auto on an absent --out is an ordinary fresh start
    rc, err = cli.train(root / "straight2", "--nproc", "2")
    assert rc == 0, err
    rc, err = cli.train(root / "straight1")
    assert rc == 0, err

    rc, err = cli.train(root / "restarted", launcher=TORCHRUN, kill_once="1:3")
    out["restarted"] = {"rc": rc, "stderr": err}

    requeued = root / "requeued"
    first = cli.train(requeued, kill_once="0:3")
    out["requeued_first"] = {"rc": first[0], "ledger": ledger_text(requeued),
                             "latest": latest_checkpoint(requeued / "checkpoints")}
    shutil.copytree(requeued, root / "changed")  # a killed run, for (c)
    rc, err = cli.train(requeued, kill_once="0:3")  # the identical command
    out["requeued"] = {"rc": rc, "stderr": err}

    early = root / "early"
    first = cli.train(early, kill_once="0:1")
    out["early_first"] = {"rc": first[0], "ledger": ledger_text(early),
                          "checkpoints": sorted(p.name for p in (early / "checkpoints")
                                                .iterdir()) if (early / "checkpoints")
                          .is_dir() else [],
                          "manifest": (early / "manifest.json").is_file()}
    rc, err = cli.train(early, kill_once="0:1")
    out["early"] = {"rc": rc, "stderr": err}
    return out


def test_torchrun_restart_after_a_killed_worker_ends_bitwise_equal(runs) -> None:
    """S10, S5, S7: rank 1 SIGKILLed in window 3 under ``torchrun --max-restarts 1``;
    the restarted workers resume from window-00000002 (said in one line) and end with
    the straight run's model, optimizer, per-rank RNG and cursor, and ledger."""
    root, result = runs["root"], runs["restarted"]
    assert result["rc"] == 0, result["stderr"][-3000:]
    assert (root / "restarted.killed").exists(), "the worker was never killed"
    lines = said(result["stderr"], "resuming")
    assert lines == [f"exactstep: resuming {root / 'restarted'} at window 2 from "
                     "window-00000002"], result["stderr"][-3000:]
    a, b = multi_rank_state(root / "straight2"), multi_rank_state(root / "restarted")
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert set(a) >= {"model", "optim", "common", "rank0", "rank1"}
    assert state_differences(a, b) == []
    assert ledger_text(root / "restarted") == ledger_text(root / "straight2")
    assert len(ledger_text(root / "straight2")) == WINDOWS


def test_requeued_command_continues_bitwise_from_its_newest_checkpoint(runs) -> None:
    """S10, S5: the command SIGKILLed in window 3 and run again unchanged resumes at
    window 2 and ends bitwise equal to the straight run (one process)."""
    root, first = runs["root"], runs["requeued_first"]
    assert first["rc"] == -signal.SIGKILL
    assert len(first["ledger"]) == 3 and first["latest"].name == "window-00000002"
    result = runs["requeued"]
    assert result["rc"] == 0, result["stderr"]
    assert said(result["stderr"], "resuming") == [
        f"exactstep: resuming {root / 'requeued'} at window 2 from window-00000002"]
    (name_a, a), (name_b, b) = (one_process_state(root / "straight1"),
                                one_process_state(root / "requeued"))
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    assert state_differences(a, b) == []
    assert ledger_text(root / "requeued") == ledger_text(root / "straight1")


def test_a_run_with_a_manifest_but_no_checkpoint_starts_again_from_window_0(runs) -> None:
    """S10, S8: killed in window 1, before the first checkpoint, the run holds its
    manifest and one ledger line; the rerun drops them, says it starts from window 0
    and ends bitwise equal to the straight run."""
    root, first = runs["root"], runs["early_first"]
    assert first["rc"] == -signal.SIGKILL
    assert first["manifest"] and len(first["ledger"]) == 1
    assert [n for n in first["checkpoints"] if not n.startswith(".")] == []
    result = runs["early"]
    assert result["rc"] == 0, result["stderr"]
    assert said(result["stderr"], "no checkpoint was published yet; starting again from "
                                  "window 0"), result["stderr"]
    assert said(result["stderr"], f"resuming {root / 'early'} at window 0")
    (_, a), (_, b) = one_process_state(root / "straight1"), one_process_state(root / "early")
    assert state_differences(a, b) == []
    assert ledger_text(root / "early") == ledger_text(root / "straight1")


def test_a_changed_configuration_is_refused_naming_the_field(runs) -> None:
    """S4, S10, X4: ``--resume auto`` with another ``update.lr`` is refused in one line
    naming the field, and the killed run's directory is byte-identical afterwards.
    Control: without ``--resume auto`` the unchanged command is refused too (the run
    directory already holds a run), also leaving it untouched."""
    cli, run_dir = runs["cli"], runs["root"] / "changed"
    before = committed(run_dir)
    rc, err = cli.train(run_dir, update__lr=0.01)
    assert rc == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--resume auto" in lines[0] and "update.lr" in lines[0], lines
    assert "update.warmup" not in lines[0] and "seed" not in lines[0]
    assert committed(run_dir) == before
    rc, err = cli.train(run_dir, auto=False)
    assert rc != 0 and len(error_lines(err)) == 1 and "already holds a run" in err, err
    assert committed(run_dir) == before


def test_each_torchrun_attempt_reads_only_its_own_keys_in_the_agents_store() -> None:
    """S10: torchrun's agent keeps one store across restarts; a restarted attempt must
    not read the dead attempt's keys (a peer's old address). Control: a store of the
    same attempt does read them, so the check can see a key when it is there."""
    from datetime import timedelta

    import torch.distributed as dist

    from exactstep.parallel.process_group import attempt_store

    timeout = timedelta(seconds=10)
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    dead = attempt_store("127.0.0.1", agent.port, 1, 2, timeout, env)
    dead.set("rank_1", "127.0.0.1:1933")
    restarted = attempt_store("127.0.0.1", agent.port, 0, 2, timeout,
                              {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert not restarted.check(["rank_1"])
    same = attempt_store("127.0.0.1", agent.port, 0, 2, timeout, env)
    assert same.check(["rank_1"]) and same.get("rank_1") == b"127.0.0.1:1933"
