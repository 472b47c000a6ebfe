"""Two "nodes" on one machine: multi-node launch, shared storage, a stalled or dead node,
restarts (D1, D3, S3, S5, S7, S10, X4; issue 30 items 1, 3 and 6; issue 37 items 6, 7).

Each node is its own launcher process, ``exactstep train --nnodes 2 --node-rank K
--rdzv-endpoint 127.0.0.1:PORT`` (one process each, c10d rendezvous, gloo), and the
job is compared with ``--nproc 2`` on one node: the final checkpoint (DCP model and
optimizer, common state, every rank's RNG and data cursor) bitwise, one ledger, and
only rank 0 writing the run directory's files (an audit hook in every worker records
what it opens for writing; rank 1 may write only its own checkpoint shards and its
storage probe). Storage: the two launchers run from different working directories
with the same relative ``--out`` (a node-local directory): one ``error:`` line per
launcher naming the fix, before any window. A stalled node (node 1's worker stops
itself with SIGSTOP) is named by node 0 within ``parallel.timeout_s``; node 1 is then
SIGKILLed whole (launcher and worker), the last published checkpoint stays, and the
two-node resume (the ``torchrun ... -m exactstep`` form) ends bitwise equal to the
straight run. A dead node (node 1's worker SIGKILLs its launcher, then itself) is named
"died or failed" by node 0 (a closed connection, not the timeout), and exactstep's own
two-node ``resume`` ends bitwise equal to the straight run. Restarts: under
``torchrun --nnodes 2 --max-restarts 1`` with rank 1 SIGKILLed once, the job with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` restarts and ends bitwise equal to the straight
run (``train --resume auto``); without it (the agents' shared store) it is refused
before window 0 in one line naming the variable.

The faults and the hook reach the workers through a ``sitecustomize`` module on
``PYTHONPATH``. Runs are sequential: two worker processes at a time.
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
from cli_support import CliRoot, tiny_overrides
from run_support import multi_rank_state as final_state

from exactstep.parallel.process_group import SHARE_STORE_VAR, free_port
from exactstep.state import latest_checkpoint
from exactstep.state.compare import state_differences

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WINDOWS, EVERY = 4, 2
FAULT_WINDOW = 3  # node 1 stalls or dies at the start of window 3: LATEST is window 2
TIMEOUT_S = 4.0  # parallel.timeout_s: the bound a stalled node is detected within
SLACK_S = 6.0  # the launcher stopping its own ranks, on a loaded 2-core machine
RUN_TIMEOUT_S = 150

HOOK = r"""
import os, signal, sys, time
_fault = os.environ.get("EXACTSTEP_TEST_NODE_FAULT")
_writes = os.environ.get("EXACTSTEP_TEST_WRITES")
if _fault and os.environ.get("RANK"):
    from exactstep.update.window import UpdateEngine
    _rank, _window, _how = (_fault.split(":", 2) + ["stall"])[:3]
    _run_window = UpdateEngine.run_window
    def _probed(self, batches, window, *args, **kwargs):
        if window == int(_window) and os.environ["RANK"] == _rank:
            if _how.startswith("kill-once="):  # this worker, in the first attempt only
                _marker = _how.split("=", 1)[1]
                if not os.path.exists(_marker):
                    open(_marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                return _run_window(self, batches, window, *args, **kwargs)
            with open(os.environ["EXACTSTEP_TEST_FAULT_TIME"], "w") as fh:
                fh.write(repr(time.time()))
            if _how == "kill-node":  # the whole node: its launcher, then this worker
                os.kill(os.getppid(), signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent: a stalled node
        return _run_window(self, batches, window, *args, **kwargs)
    UpdateEngine.run_window = _probed
if _writes and os.environ.get("RANK"):
    import atexit
    _seen = set()
    _root = os.environ["EXACTSTEP_TEST_RUN_DIR"]
    def _note(path):
        if hasattr(path, "__fspath__"):
            path = os.fspath(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(path, str):
            path = os.path.abspath(path)
            if path.startswith(_root + os.sep):
                _seen.add(os.path.relpath(path, _root))
    def _audit(event, args):
        if event == "open" and args[0] is not None:
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)):
                _note(args[0])
        elif event in ("os.rename", "os.replace", "os.link"):
            _note(args[1])
        elif event in ("os.mkdir", "os.remove"):
            _note(args[0])
    sys.addaudithook(_audit)
    def _dump():
        with open(os.path.join(_writes, "rank" + os.environ["RANK"]), "w") as fh:
            fh.write("\n".join(sorted(_seen)))
    atexit.register(_dump)
"""


def overrides(corpus: Path) -> list[str]:
    return tiny_overrides(corpus, windows=WINDOWS, every=EVERY,
                          extra={"parallel.timeout_s": TIMEOUT_S})


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own,
    so a process group would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process it started (the test's own processes)."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


class Nodes(CliRoot):
    """Starts ``exactstep`` commands as a one-node job or as two "nodes" on localhost."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, HOOK)

    def env(self, **extra: str) -> dict[str, str]:
        """The workers' environment; torchrun's store variable only where a test sets it."""
        env = super().env(**extra)
        if SHARE_STORE_VAR not in extra:
            env.pop(SHARE_STORE_VAR, None)
        return env

    def start(self, args: list[str], *, cwd: Path | None = None, **env: str) -> subprocess.Popen:
        argv = args if args[:1] == ["-m"] else ["-m", "exactstep", *args]
        return process_server.Popen([sys.executable, *argv], cwd=cwd or self.root,
                                    env=self.env(**env), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)

    def one(self, *args: str) -> tuple[int, str]:
        proc = self.start([*args, "--nproc", "2"])
        _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        return proc.returncode, err

    def two(self, command: list[str], *, cwds: tuple[Path, Path] | None = None,
            env: dict[str, str] | None = None, node1_env: dict[str, str] | None = None,
            stop_node1_after_node0: bool = False, torchrun: bool = False,
            max_restarts: int = 0) -> list[dict]:
        """``command`` on node 0 and node 1 (``env`` on both, ``node1_env`` on node 1);
        returns each node's exit code, stderr and end time. ``torchrun``: the
        documented ``torchrun --nnodes 2 ... -m exactstep <command>`` form instead,
        with ``--max-restarts max_restarts``."""
        port = free_port()
        procs = []
        for node in (0, 1):
            flags = ["--nnodes", "2", "--node-rank", str(node),
                     "--rdzv-endpoint", f"127.0.0.1:{port}"]
            argv = [*command, *flags]
            if torchrun:
                argv = ["-m", "torch.distributed.run", *flags, "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-id", "job",
                        "--max-restarts", str(max_restarts), "-m", "exactstep", *command]
            procs.append(self.start(argv, cwd=cwds[node] if cwds else None,
                                    **(env or {}), **((node1_env or {}) if node else {})))
        out = []
        for node, proc in enumerate(procs):
            if node == 1 and stop_node1_after_node0:
                kill_node(proc)  # the stalled node: what its scheduler would do
            try:
                _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                kill_node(proc)
                _, err = proc.communicate()
            out.append({"rc": proc.returncode, "stderr": err, "ended": time.time()})
        return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The run root and the straight one-node run (``--nproc 2``) every job is compared
    with."""
    root = tmp_path_factory.mktemp("multinode")
    nodes = Nodes(root)
    sets = overrides(nodes.corpus)
    rc, err = nodes.one("train", "--no-progress", "--out", str(root / "one"), *sets)
    assert rc == 0, err
    return {"root": root, "nodes": nodes, "sets": sets, "one": root / "one"}


@pytest.fixture(scope="module")
def jobs(reference) -> dict:
    out = dict(reference)
    root, nodes, sets = reference["root"], reference["nodes"], reference["sets"]

    two, writes = root / "two", root / "writes"
    writes.mkdir()
    out["two"] = nodes.two(["train", "--no-progress", "--out", str(two), *sets],
                           env={"EXACTSTEP_TEST_WRITES": str(writes),
                                "EXACTSTEP_TEST_RUN_DIR": str(two)})
    out["two_dir"], out["writes"] = two, writes

    stalled = root / "stalled"
    fault = {"EXACTSTEP_TEST_NODE_FAULT": f"1:{FAULT_WINDOW}",
             "EXACTSTEP_TEST_FAULT_TIME": str(root / "stalled-at")}
    out["stalled"] = nodes.two(["train", "--no-progress", "--out", str(stalled), *sets],
                               node1_env=fault, stop_node1_after_node0=True)
    out["stalled_at"] = float((root / "stalled-at").read_text())
    out["latest_after_stall"] = latest_checkpoint(stalled / "checkpoints")
    out["resumed"] = nodes.two(["resume", str(stalled), "--no-progress"], torchrun=True)
    out["stalled_dir"] = stalled
    return out


def test_two_nodes_end_bitwise_equal_to_one_node_with_one_ledger(jobs) -> None:
    """D1, D3, S7: 2 nodes x 1 process = 1 node x 2 processes, bitwise, one ledger."""
    assert [n["rc"] for n in jobs["two"]] == [0, 0], [n["stderr"] for n in jobs["two"]]
    a, b = final_state(jobs["one"]), final_state(jobs["two_dir"])
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert any(k.startswith("state.") for k in a["optim"])  # keyed by parameter name
    assert set(a) >= {"model", "optim", "common", "rank0", "rank1"}
    assert state_differences(a, b) == []
    ledger = (jobs["two_dir"] / "ledger.jsonl").read_text().splitlines()
    assert len(ledger) == WINDOWS
    assert ledger == (jobs["one"] / "ledger.jsonl").read_text().splitlines()
    assert not any(error_lines(n["stderr"]) for n in jobs["two"])
    # control: nodes that took each other's shards (rank 0's cursor and RNG on rank 1)
    # would be caught by the same comparison
    swapped = {**b, "rank0": b["rank1"], "rank1": b["rank0"]}
    assert any(d.startswith("rank0.") for d in state_differences(a, swapped))


def test_only_rank_0_writes_the_run_directory_files(jobs) -> None:
    """S3, U4: the manifest, ledger, metrics, summary and publications are rank 0's;
    rank 1 writes only its own shards inside a checkpoint's temporary directory (and
    its storage probe). Control: the same hook sees rank 0 write them."""
    rank0 = set((jobs["writes"] / "rank0").read_text().split())
    rank1 = set((jobs["writes"] / "rank1").read_text().split())
    assert {"manifest.json", "ledger.jsonl", "metrics.jsonl", "summary.json"} <= rank0
    assert any(p.startswith("checkpoints/LATEST") for p in rank0)
    assert rank1, "the hook must see rank 1's own checkpoint shards"
    for path in rank1:
        parts = Path(path).parts
        own_shard = (parts[0] == "checkpoints" and parts[1].startswith(".tmp-")
                     and parts[-1] not in ("manifest.json", "common.pt", "rank-00000.pt"))
        assert own_shard or path == ".exactstep-probe-00001", path
    assert "__1_0.distcp" in {Path(p).name for p in rank1}  # its DCP shard (torch.save
    # opens its files in C++, unseen by the hook; rank-00001.pt is covered by the rule)


def test_stalled_node_is_named_within_the_timeout(jobs) -> None:
    """D1, X4: node 1's worker stops (SIGSTOP: alive and silent); node 0's launcher ends
    within parallel.timeout_s with one line naming node 1, rank 1 and the bound, and the
    command that continues on every node; the last published checkpoint stays intact.
    (Node 1 is then SIGKILLed whole, launcher and worker, as its scheduler would.)"""
    node0 = jobs["stalled"][0]
    assert node0["rc"] != 0
    waited = node0["ended"] - jobs["stalled_at"]
    assert TIMEOUT_S <= waited < TIMEOUT_S + SLACK_S, waited
    lines = error_lines(node0["stderr"])
    assert len(lines) == 1, node0["stderr"]
    assert "node 1 (rank 1) stopped answering" in lines[0], lines
    assert f"{TIMEOUT_S:g} s (parallel.timeout_s)" in lines[0], lines
    assert "exactstep resume" in lines[0] and "--node-rank" in lines[0], lines
    assert "Traceback" not in node0["stderr"]
    latest = jobs["latest_after_stall"]
    assert latest is not None
    assert latest.name == f"window-{FAULT_WINDOW - FAULT_WINDOW % EVERY:08d}"
    from exactstep.state import verify_checkpoint

    assert verify_checkpoint(latest).ok


def test_restart_after_a_stalled_and_killed_node_resumes_bitwise(jobs) -> None:
    """S5, S7 across nodes: both nodes resumed from the last published checkpoint (by
    the documented ``torchrun --nnodes 2 --rdzv-backend c10d ... -m exactstep resume``)
    end bitwise equal to the straight one-node run, with the same ledger."""
    assert [n["rc"] for n in jobs["resumed"]] == [0, 0], [n["stderr"] for n in jobs["resumed"]]
    a, b = final_state(jobs["one"]), final_state(jobs["stalled_dir"])
    assert state_differences(a, b) == []
    assert ((jobs["stalled_dir"] / "ledger.jsonl").read_text()
            == (jobs["one"] / "ledger.jsonl").read_text())


def test_dead_node_line_names_the_node_and_its_ranks() -> None:
    """X4: when every rank of this node failed only because a peer's connection closed
    (another node's launcher and workers SIGKILLed), the line names the other nodes and
    their ranks. torchrun's failure records are fabricated (its fields: exitcode,
    message, timestamp), as in test_stall_and_reporting, for 3 nodes x 2 processes; the
    live runs cover a stall and a killed node (test_a_killed_node_is_named_dead_...)."""
    from types import SimpleNamespace

    from exactstep.parallel import launch

    nodes = launch.Nodes(3, 0, "10.0.0.1:29500")
    closed = ("rank {r} of 6: a collective failed (Connection closed by peer); another "
              "rank probably died or stalled")
    failures = {r: SimpleNamespace(exitcode=1, timestamp=10 + r,
                                   message={"message": closed.format(r=r)}) for r in (0, 1)}
    rank, root = launch.root_cause(failures)
    line = launch.failure_line(rank, root, failures, None, ["train", "--out", "r"], 2, nodes)
    assert line.startswith("error: node 1 (ranks 2, 3); node 2 (ranks 4, 5) died or failed")
    assert "rank 0 on node 0" in line and "--nnodes 3 --node-rank 0" in line
    # control: the same failures on a one-node job are not blamed on another node
    single = launch.failure_line(rank, root, failures, None, ["train", "--out", "r"], 2)
    assert "node" not in single.split(";")[0]


def test_node_local_run_directory_is_refused_before_any_window(jobs, tmp_path) -> None:
    """D1, S3: the same relative --out from two working directories is two directories
    (what a node-local disk gives): each launcher prints one line naming the fix, no
    window runs and no run files are left. Control: the straight two-node job (one
    shared directory) passed the same check."""
    nodes = jobs["nodes"]
    cwds = (tmp_path / "node0", tmp_path / "node1")
    for cwd in cwds:
        cwd.mkdir()
    ends = nodes.two(["train", "--no-progress", "--out", "run", *jobs["sets"]], cwds=cwds)
    for end in ends:
        assert end["rc"] == 2, end["stderr"]
        lines = error_lines(end["stderr"])
        assert len(lines) == 1, end["stderr"]
        assert "is not shared" in lines[0] and "--out" in lines[0], lines
        assert str(cwds[1] / "run") in lines[0] and "rank 1" in lines[0], lines
        assert "Traceback" not in end["stderr"]
    assert not (cwds[0] / "run").exists()  # rank 0's start left nothing behind
    assert not any((cwds[1] / "run").glob("*"))  # rank 1 made an empty directory at most
    assert all(n["rc"] == 0 for n in jobs["two"])


def test_node_flags_are_checked_before_anything_runs(tmp_path) -> None:
    """X4: a bad --nnodes / --node-rank / --rdzv-endpoint is one line, exit 2, at once."""
    for flags, words in ((["--nnodes", "2"], "--rdzv-endpoint"),
                         (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
                          "--node-rank"),
                         (["--nnodes", "2", "--rdzv-endpoint", "nohostport"], "HOST:PORT"),
                         (["--nnodes", "0"], "--nnodes")):
        proc = process_server.run([sys.executable, "-m", "exactstep", "train", "--out",
                               str(tmp_path / "r"), *flags], capture_output=True, text=True,
                                  timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = error_lines(proc.stderr)
        assert len(lines) == 1 and words in lines[0], proc.stderr
    assert not (tmp_path / "r").exists()


def test_launch_flags_never_reach_the_workers() -> None:
    from exactstep.parallel.launch import strip_launch_flags

    argv = ["train", "--nnodes", "2", "--node-rank=1", "--rdzv-endpoint", "h:29500",
            "--rdzv-id", "j", "--rdzv-backend=c10d", "--nproc", "2", "--out", "r"]
    assert strip_launch_flags(argv) == ["train", "--out", "r"]
    assert json.dumps(strip_launch_flags(["resume", "r"])) == '["resume", "r"]'


def test_resume_on_a_node_that_sees_no_manifest_names_shared_storage(tmp_path,
                                                                     monkeypatch) -> None:
    """D1, X4: a rank other than 0 that finds no run manifest (its node's own disk) is
    told the run directory is probably not shared; rank 0 (control) and a single
    process keep the plain message."""
    from exactstep.errors import DistributedError, ResumeError
    from exactstep.run.continuation import read_run_manifest

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ResumeError):
        read_run_manifest(tmp_path / "run")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ResumeError):
        read_run_manifest(tmp_path / "run")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(DistributedError, match="rank 1 of 2 on .*not shared"):
        read_run_manifest(tmp_path / "run")


@pytest.fixture(scope="module")
def dead_node(reference) -> dict:
    """Issue 37 item 7: at the start of window ``FAULT_WINDOW`` rank 1's worker SIGKILLs
    its launcher (the node's agent), then itself: a node gone whole, as when its host
    dies. Then exactstep's own two-node ``resume`` (the command the line names)."""
    root, nodes, sets = reference["root"], reference["nodes"], reference["sets"]
    killed = root / "killed"
    fault = {"EXACTSTEP_TEST_NODE_FAULT": f"1:{FAULT_WINDOW}:kill-node",
             "EXACTSTEP_TEST_FAULT_TIME": str(root / "killed-at")}
    out: dict = {"dir": killed}
    out["ends"] = nodes.two(["train", "--no-progress", "--out", str(killed), *sets], env=fault)
    out["killed_at"] = float((root / "killed-at").read_text())
    out["latest"] = latest_checkpoint(killed / "checkpoints")
    out["resumed"] = nodes.two(["resume", str(killed), "--no-progress"])
    return out


def test_a_killed_node_is_named_dead_by_the_other_node(dead_node) -> None:
    """D1, X4: node 1's launcher and worker SIGKILLed in window 3; the other launcher
    ends with one line naming node 1 and its rank as gone (a closed connection: "died
    or failed", not the timeout's "stopped answering") and the command that continues
    on every node; the last published checkpoint stays intact. (The fabricated
    records of test_dead_node_line_names_the_node_and_its_ranks cover 3 nodes x 2.)"""
    ends = dead_node["ends"]
    [survivor] = [e for e in ends if e["rc"] != -signal.SIGKILL]  # the other was killed
    assert survivor["rc"] not in (0, None), survivor["stderr"]
    assert survivor["ended"] - dead_node["killed_at"] < TIMEOUT_S + SLACK_S
    lines = error_lines(survivor["stderr"])
    assert len(lines) == 1, survivor["stderr"]
    assert lines[0].startswith("error: node 1 (rank 1) died or failed: rank 0 on node 0 "
                               "lost its connection in a collective"), lines
    assert "stopped answering" not in lines[0] and "parallel.timeout_s" not in lines[0]
    assert f"'exactstep resume {dead_node['dir']} --nproc 1 --nnodes 2 --node-rank" in lines[0]
    assert "--resume auto on every node" in lines[0], lines
    assert "Traceback" not in survivor["stderr"]
    latest = dead_node["latest"]
    assert latest is not None and latest.name == f"window-{FAULT_WINDOW - FAULT_WINDOW % EVERY:08d}"
    from exactstep.state import verify_checkpoint

    assert verify_checkpoint(latest).ok


def test_two_nodes_resume_bitwise_after_a_killed_node(dead_node, reference) -> None:
    """S5, S7: ``exactstep resume RUN --nnodes 2 ...`` on both nodes after the killed
    node ends bitwise equal to the straight one-node run, with the same ledger."""
    ends = dead_node["resumed"]
    assert [e["rc"] for e in ends] == [0, 0], [e["stderr"] for e in ends]
    a, b = final_state(reference["one"]), final_state(dead_node["dir"])
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert state_differences(a, b) == []
    assert ((dead_node["dir"] / "ledger.jsonl").read_text()
            == (reference["one"] / "ledger.jsonl").read_text())


@pytest.fixture(scope="module")
def restarts(reference) -> dict:
    """Issue 37 item 6: ``torchrun --nnodes 2 --nproc-per-node 1 --max-restarts 1 ...
    train --resume auto`` with rank 1 SIGKILLed once at the start of window
    ``FAULT_WINDOW``: with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (every restart a
    fresh store), and without it (the agents' shared store: refused)."""
    root, nodes, sets = reference["root"], reference["nodes"], reference["sets"]
    train = ["train", "--no-progress", "--resume", "auto"]
    out: dict = {}
    for name, extra in (("restarted", {SHARE_STORE_VAR: "1"}), ("refused", {})):
        marker = root / f"{name}.killed"
        fault = {"EXACTSTEP_TEST_NODE_FAULT": f"1:{FAULT_WINDOW}:kill-once={marker}"}
        out[name] = nodes.two([*train, "--out", str(root / name), *sets], torchrun=True,
                              max_restarts=1, env={**fault, **extra})
        out[f"{name}_dir"], out[f"{name}_marker"] = root / name, marker
    return out


def test_a_restarted_two_node_job_ends_bitwise_equal_to_a_straight_run(restarts,
                                                                       reference) -> None:
    """S10, S5, S7: rank 1 SIGKILLed in window 3 of a 2-node x 1-process torchrun job
    with --max-restarts 1 and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; both agents
    restart their workers, which resume from window-00000002 (said once, by rank 0)
    and end with the straight run's model, optimizer, per-rank RNG and cursor, and
    ledger."""
    ends, run_dir = restarts["restarted"], restarts["restarted_dir"]
    assert [e["rc"] for e in ends] == [0, 0], [e["stderr"][-3000:] for e in ends]
    assert restarts["restarted_marker"].exists(), "the worker was never killed"
    said = [line for e in ends for line in e["stderr"].splitlines()
            if line.startswith("exactstep: resuming")]
    assert said == [f"exactstep: resuming {run_dir} at window 2 from window-00000002"], said
    assert not any(error_lines(e["stderr"]) for e in ends)
    a, b = final_state(reference["one"]), final_state(run_dir)
    assert a["name"] == b["name"] == f"window-{WINDOWS:08d}"
    assert state_differences(a, b) == []
    assert (run_dir / "ledger.jsonl").read_text() == (reference["one"] / "ledger.jsonl").read_text()


def test_a_two_node_restart_over_the_shared_store_is_refused_in_one_line(restarts) -> None:
    """S10, X4: the same job without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the agents'
    store, whose attempt prefixes the nodes could pick apart) is refused before window
    0 in one line naming the variable, however often torchrun restarts the refused
    workers; nothing ran (no window, no ledger). Control: the same job with the
    variable ran and restarted (the test above)."""
    ends, run_dir = restarts["refused"], restarts["refused_dir"]
    assert all(e["rc"] != 0 for e in ends), [e["stderr"][-3000:] for e in ends]
    lines = [line for e in ends for line in error_lines(e["stderr"])]
    assert len(lines) == 1, [e["stderr"][-3000:] for e in ends]
    assert f"{SHARE_STORE_VAR}=1" in lines[0] and "--max-restarts 1 on 2 nodes" in lines[0]
    assert not restarts["refused_marker"].exists()  # no worker reached window 3
    assert not (run_dir / "ledger.jsonl").exists() and not (run_dir / "manifest.json").exists()
    assert latest_checkpoint(run_dir / "checkpoints") is None
