"""Launching many processes and turning their failures into one message (D1, X4).

Workers start under ``torchrun`` or through ``exactstep train --nproc R``
(``relaunch``); a failed or stalled collective becomes a ``DistributedError``, every
rank records its error for the launcher, and the user sees one ``error:`` line naming
the root cause; a forwarded SIGTERM / SIGINT ends with a checkpoint and exit 130.
Design and derivations: docs/design/parallel.md#parallellaunchpy (D1, X4).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactstep.errors import RESUME_AUTO_HINT, DistributedError, ExactstepError, Interrupted
from exactstep.parallel.process_group import (
    ERROR_FILE_VAR,
    PEER_FAILURE_TEXT,
    PEER_TIMEOUT_TEXT,
    RANK_RECORD_FILE,
    SHARE_STORE_VAR,
    DistContext,
    PeerFailure,
    peer_failure,
)

# Fragments of the messages torch.distributed raises when a peer is gone or stalls.
PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "broken pipe",
)
# Signals with which the launcher stops the workers that are left after one failed.
LAUNCHER_STOP_SIGNALS = (signal.SIGTERM, signal.SIGKILL)


def is_peer_failure(exc: BaseException) -> bool:
    """True for the errors torch.distributed raises when another rank is gone."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in PEER_FAILURE_MARKERS)


@contextlib.contextmanager
def collective_guard(ctx: DistContext) -> Iterator[None]:
    """Re-raise a failed collective inside the block as one ``DistributedError``.

    Any other exception passes through unchanged (a bug keeps its traceback).
    """
    try:
        yield
    except ExactstepError:
        raise
    except RuntimeError as exc:
        if ctx.distributed and is_peer_failure(exc):
            raise peer_failure(ctx, exc) from None
        raise


def report_failure(exc: ExactstepError, ctx: DistContext | None,
                   env: Mapping[str, str] | None = None) -> None:
    """Print ``error: ...`` once (rank 0) and record it for the launcher (every rank).

    A ``PeerFailure`` under a launcher is recorded but not printed: it is the echo of
    another rank's failure, and the launcher reports that root cause (one line, X4);
    so is a refusal an earlier attempt of the same job printed already (``repeated``).
    """
    env = os.environ if env is None else env
    rank = ctx.rank if ctx is not None else int(env.get("RANK", "0"))
    path = env.get(ERROR_FILE_VAR)
    if path:
        write_error_file(path, rank, exc)
    echo = isinstance(exc, PeerFailure) or getattr(exc, "repeated", False)
    if rank == 0 and not (path and echo):
        print(f"error: {one_line(str(exc))}", file=sys.stderr, flush=True)


def one_line(message: str) -> str:
    """``message`` on one line: line breaks (e.g. from a path or value the user gave)
    become ``" | "``, so the user always sees exactly one ``error:`` line (X4)."""
    return " | ".join(part.strip() for part in message.splitlines() if part.strip())


#: The exit code a worker's error file records beside its message: the launcher's own
#: stop signal may still reach a worker that reported and was on its way out.
EXIT_CODE_KEY = "exactstepExitCode"


def write_error_file(path: str, rank: int, exc: BaseException) -> None:
    """torchrun's per-worker error file format: the launcher reads ``message``, and
    ``exit_code_of`` the exit code the worker was returning (``EXIT_CODE_KEY``)."""
    code = getattr(exc, "exit_code", 1)
    record = {"message": {"message": f"rank {rank}: {exc}",
                          "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time())),
                                        EXIT_CODE_KEY: code}}}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(record, fh)


@dataclass(frozen=True)
class Nodes:
    """torchrun's multi-node flags (D1), under the names torchrun gives them.

    ``nnodes`` launchers, one per node, meet at ``endpoint`` (``HOST:PORT``) under the
    rendezvous ``backend`` and ``rdzv_id``. Under ``c10d`` the rendezvous numbers the
    nodes itself; ``node_rank`` 0 is the node that hosts the rendezvous store. Under
    ``static`` ``node_rank`` is the node's rank, as with torchrun.
    """

    nnodes: int = 1
    node_rank: int = 0
    endpoint: str = "127.0.0.1:0"
    rdzv_id: str = "exactstep"
    backend: str = "c10d"

    @property
    def many(self) -> bool:
        return self.nnodes > 1

    def flags(self) -> str:
        """The flags that repeat this launch on this node (empty on one node)."""
        if not self.many:
            return ""
        own = (f" --rdzv-id {self.rdzv_id}" if self.rdzv_id != Nodes.rdzv_id else "") + (
            f" --rdzv-backend {self.backend}" if self.backend != Nodes.backend else "")
        return (f" --nnodes {self.nnodes} --node-rank {self.node_rank} --rdzv-endpoint "
                f"{self.endpoint}{own}")

    def node_of(self, rank: int, nproc: int) -> int:
        """The node (rendezvous group rank) of global ``rank``: torchrun numbers a
        node's ``nproc`` workers consecutively."""
        return rank // nproc


# The launcher's own flags: what ``relaunch`` consumes and the workers never see.
LAUNCH_FLAGS = ("--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id",
                "--rdzv-backend")


def strip_launch_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launcher's flags (``LAUNCH_FLAGS``, ``--x V`` or ``--x=V``)."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item in LAUNCH_FLAGS:
            i += 2
            continue
        if item.split("=", 1)[0] in LAUNCH_FLAGS and "=" in item:
            i += 1
            continue
        out.append(item)
        i += 1
    return out


def strip_nproc(argv: Sequence[str]) -> tuple[list[str], int | None]:
    """``argv`` without ``--nproc R`` / ``--nproc=R``, and R (None when absent)."""
    out: list[str] = []
    nproc: int | None = None
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--nproc" and i + 1 < len(items):
            nproc, i = _positive(items[i + 1]), i + 2
            continue
        if item.startswith("--nproc="):
            nproc, i = _positive(item.split("=", 1)[1]), i + 1
            continue
        out.append(item)
        i += 1
    return out, nproc


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DistributedError(f"--nproc expects a positive number of processes; got {text!r}")
    return value


def relaunch(argv: Sequence[str], nproc: int, *, timeout_s: float = 300.0,
             nodes: Nodes | None = None) -> int:
    """Run ``exactstep <argv>`` as ``nproc`` local workers under torchrun's launcher;
    with ``nodes`` (``--nnodes N``) as this node's share of an N-node job, whose
    launchers meet at ``nodes.endpoint`` within ``timeout_s``.

    Returns 0 on success. On failure prints one line naming the first failing rank
    and its message (unless that rank is 0, which printed it already) and returns
    that worker's exit code (1 when unknown).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    nodes = nodes or Nodes()
    quiet_launcher_logs()
    rdzv: dict[str, Any] = {"timeout": int(timeout_s)}
    if nodes.many and nodes.backend == "static":
        rdzv["rank"] = nodes.node_rank
    elif nodes.many:  # node 0 hosts the rendezvous store: no race for the port
        rdzv["is_host"] = nodes.node_rank == 0
    # the workers' error files land here (read after a signal) and go away afterwards
    with (tempfile.TemporaryDirectory(prefix="exactstep-launch-") as log_dir,
          fresh_store_per_round(nodes)):
        config = LaunchConfig(
            min_nodes=nodes.nnodes,
            max_nodes=nodes.nnodes,
            nproc_per_node=nproc,
            run_id=nodes.rdzv_id if nodes.many else f"exactstep-{os.getpid()}",
            rdzv_backend=nodes.backend if nodes.many else "c10d",
            rdzv_endpoint=nodes.endpoint if nodes.many else "127.0.0.1:0",
            rdzv_configs=rdzv,
            max_restarts=0,
            monitor_interval=0.5,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        try:
            elastic_launch(config, sys.executable)("-m", "exactstep", *argv)
        except ChildFailedError as exc:
            return report_child_failure(exc, argv, nproc, Path(log_dir), nodes)
        except SignalException as exc:
            return report_signal(exc.sigval, Path(log_dir), argv, nproc, nodes)
    return 0


@contextlib.contextmanager
def fresh_store_per_round(nodes: Nodes) -> Iterator[None]:
    """Several nodes: every rendezvous round forms over a fresh store hosted by its
    rank 0 (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the agent, read by torch's
    c10d rendezvous), not over one store the agents keep for the whole job, whose
    keys a later round would read under an attempt count the nodes need not share
    (S10, ``process_group.shared_store_restarts``). A value the user set stands."""
    if not nodes.many or SHARE_STORE_VAR in os.environ:
        yield
        return
    os.environ[SHARE_STORE_VAR] = "1"
    try:
        yield
    finally:
        os.environ.pop(SHARE_STORE_VAR, None)


def quiet_launcher_logs() -> None:
    """Silence torchrun's own log lines (e.g. "Received 15 death signal"): each of its
    modules sets its logger's level itself, so the parent's level alone is not enough.
    What they would say is reported below as one ``error:`` line."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def report_signal(sigval: int, log_dir: Path, argv: Sequence[str], nproc: int,
                  nodes: Nodes | None = None) -> int:
    """After torchrun forwarded a signal to the workers and they exited: one line
    (rank 0's own, unless it never got to report) and the exit code 130."""
    if not rank_reported(log_dir, 0):
        name = signal_name(sigval)
        print(f"error: stopped by {name} before the workers reported; continue from the last "
              f"committed checkpoint, if any, with {resume_hint(argv, nproc, nodes)}",
              file=sys.stderr, flush=True)
    return Interrupted.exit_code


def signal_name(sigval: Any) -> str:
    """``SIGTERM`` for 15 (or for ``signal.SIGTERM``); ``signal N`` when unknown."""
    try:
        return signal.Signals(int(sigval)).name
    except (TypeError, ValueError):
        return f"signal {sigval}"


def rank_reported(log_dir: Path, rank: int) -> bool:
    """Whether worker ``rank`` wrote its error file (``report_failure``) under
    torchrun's log layout ``<log_dir>/<run>/attempt_<n>/<rank>/error.json``."""
    return any(log_dir.glob(f"*/attempt_*/{rank}/error.json"))


def report_child_failure(exc: Any, argv: Sequence[str], nproc: int,
                         log_dir: Path | None = None, nodes: Nodes | None = None) -> int:
    """One line for a failed worker (unless rank 0 printed its own) and its exit code."""
    failures = exc.failures
    rank, failure = root_cause(failures)
    record = rank_record(log_dir, rank) if log_dir is not None else None
    line = failure_line(rank, failure, failures, record, argv, nproc, nodes)
    if line is not None:
        print(line, file=sys.stderr, flush=True)
    return exit_code_of(failure)


def exit_code_of(failure: Any) -> int:
    """The exit code the job ends with for its root-cause ``failure``: the worker's own
    when it exited with one; else the one its error file records, when it reported and
    was then ended by a signal (the launcher stops every worker once one has exited,
    and a worker that reported a clean stop, 130, may still be tearing down); else 1."""
    if failure.exitcode is not None and failure.exitcode > 0:
        return int(failure.exitcode)
    message = failure.message
    info = message.get("extraInfo") if isinstance(message, dict) else None
    recorded = info.get(EXIT_CODE_KEY) if isinstance(info, dict) else None
    return recorded if isinstance(recorded, int) and recorded > 0 else 1


def failure_line(rank: int, failure: Any, failures: Mapping[int, Any],
                 record: Mapping[str, Any] | None, argv: Sequence[str],
                 nproc: int, nodes: Nodes | None = None) -> str | None:
    """The one ``error:`` line for the root-cause ``failure`` of ``rank`` (X4, D1), or
    None when rank 0 already printed its own error.

    ``failure`` has torchrun's fields (``exitcode``, ``message``, ``timestamp``);
    ``failures`` holds every rank's; ``record`` is the rank's record (or None).
    """
    message = failure_text(failure)
    resume = f"continue from the last committed checkpoint with {resume_hint(argv, nproc, nodes)}"
    if nodes is not None and nodes.many and PEER_FAILURE_TEXT in message:
        return other_node_line(rank, message, failures, nproc, nodes, resume)
    if killed_without_report(failure):
        sig = signal_name(-failure.exitcode)
        if record and record.get("backend") == "nccl" and sig == "SIGABRT":
            bound = record.get("timeout_s")
            within = f" within {bound:g} s (parallel.timeout_s)" if bound is not None else ""
            stopped = stopped_by_launcher(failures, rank)
            suspects = (f"rank {', '.join(map(str, stopped))} was still running when the "
                        "launcher stopped it (it probably stalled)" if stopped
                        else "another rank probably stalled or died")
            return (f"error: rank {rank} of {nproc} was taken down by the NCCL watchdog "
                    f"(SIGABRT): an NCCL collective did not complete{within} or NCCL "
                    f"failed; the NCCL lines above name the collective; {suspects}; {resume}")
        waiter = timed_out_waiting(failures, rank)
        if waiter is not None and sig in {s.name for s in LAUNCHER_STOP_SIGNALS}:
            return (f"error: rank {rank} of {nproc} stalled: rank {waiter} waited "
                    f"{timeout_of(failures[waiter])} for it in a collective and gave up, "
                    f"then the launcher stopped rank {rank} ({sig}); {resume}")
        return (f"error: rank {rank} of {nproc} died ({message or 'killed by a signal'}); "
                f"the other ranks were stopped; {resume}")
    if rank != 0 and said_by_rank_zero(rank, message, failures):
        return None  # every rank refused alike and rank 0 printed it a second later
    if rank != 0 or not message or PEER_FAILURE_TEXT in message:
        # rank 0 printed its own (non-peer) error already; every other case is ours
        text = one_line(message) or f"rank {rank} exited with code {failure.exitcode}"
        return f"error: {text}"
    return None


def said_by_rank_zero(rank: int, message: str, failures: Mapping[int, Any]) -> bool:
    """Whether rank 0 reported the same error as ``rank`` (its own, not a peer's echo):
    a refusal every rank makes alike (a layout a model cannot split) that ``rank`` raised
    in an earlier second than rank 0; rank 0 printed it, so a second line would repeat
    it (X4)."""
    zero = failures.get(0)
    if zero is None or not message:
        return False
    said = failure_text(zero)
    if PEER_FAILURE_TEXT in said or killed_without_report(zero):
        return False
    return said.removeprefix("rank 0: ") == message.removeprefix(f"rank {rank}: ")


def resume_hint(argv: Sequence[str], nproc: int, nodes: Nodes | None) -> str:
    """The commands that continue the run (on every node, for a multi-node job):
    ``exactstep resume``, or the same ``train`` command with ``--resume auto`` (S10)."""
    command = f"'exactstep resume {run_dir_of(argv)} --nproc {nproc}"
    if nodes is None or not nodes.many:
        return f"{command}', {RESUME_AUTO_HINT}"
    return (f"{command}{nodes.flags()}' on this node and the same, with its own "
            f"--node-rank, on every other node, {RESUME_AUTO_HINT} on every node")


def other_node_line(rank: int, message: str, failures: Mapping[int, Any], nproc: int,
                    nodes: Nodes, resume: str) -> str:
    """Every rank of this node failed only because a peer did not answer (a stalled or
    dead node, D1, X4): name the other nodes and their ranks, and the bound waited."""
    mine = {nodes.node_of(r, nproc) for r in failures}
    others = [n for n in range(nodes.nnodes) if n not in mine]
    named = "; ".join(
        f"node {n} (rank{'s' if nproc > 1 else ''} "
        f"{', '.join(str(r) for r in range(n * nproc, (n + 1) * nproc))})" for n in others)
    here = f"node {min(mine)}" if mine else "this node"
    if PEER_TIMEOUT_TEXT in message:
        what = (f"stopped answering: rank {rank} on {here} waited {timeout_of_text(message)} "
                "for it in a collective and gave up (it stalled or its host is unreachable)")
    else:
        what = (f"died or failed: rank {rank} on {here} lost its connection in a collective; "
                "if it failed, its own launcher names the cause")
    return (f"error: {named or 'another node'} {what}; the ranks of {here} were stopped; "
            f"{resume}")


def killed_without_report(failure: Any) -> bool:
    """Ended by a signal before it could write an error of its own."""
    return (failure.exitcode is not None and failure.exitcode < 0
            and not isinstance(failure.message, dict))


def stopped_by_launcher(failures: Mapping[int, Any], rank: int) -> list[int]:
    """Ranks other than ``rank`` that ended by the launcher's stop signals without a
    report: they were still running after the first failure."""
    names = {s.name for s in LAUNCHER_STOP_SIGNALS}
    return sorted(r for r, f in failures.items()
                  if r != rank and killed_without_report(f)
                  and signal_name(-f.exitcode) in names)


def timed_out_waiting(failures: Mapping[int, Any], rank: int) -> int | None:
    """The lowest rank (other than ``rank``) whose collective timed out, or None."""
    waiting = [r for r, f in failures.items()
               if r != rank and PEER_TIMEOUT_TEXT in failure_text(f)]
    return min(waiting) if waiting else None


def timeout_of(failure: Any) -> str:
    """The bound a peer failure names ("3 s (parallel.timeout_s)"), from its text."""
    return timeout_of_text(failure_text(failure))


def timeout_of_text(text: str) -> str:
    """The bound named in a peer failure's ``text``."""
    _, _, after = text.partition(PEER_TIMEOUT_TEXT + " ")
    return after.split(";")[0].strip() or "parallel.timeout_s"


def rank_record(log_dir: Path, rank: int) -> dict[str, Any] | None:
    """Worker ``rank``'s record (``process_group.write_rank_record``) under torchrun's
    log layout, or None when it wrote none (or it cannot be read)."""
    for path in Path(log_dir).glob(f"*/attempt_*/{rank}/{RANK_RECORD_FILE}"):
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    return None


def run_dir_of(argv: Sequence[str]) -> str:
    """The run directory named by a ``train`` (``--out``) or ``resume`` command line."""
    items = list(argv)
    for i, item in enumerate(items):
        if item == "--out" and i + 1 < len(items):
            return items[i + 1]
        if item.startswith("--out="):
            return item.split("=", 1)[1]
    if items[:1] == ["resume"]:
        positional = [a for i, a in enumerate(items[1:], 1)
                      if not a.startswith("-") and items[i - 1] not in RESUME_VALUED]
        if positional:
            return positional[0]
    return "runs/default" if items[:1] == ["train"] else "RUN_DIR"


RESUME_VALUED = ("--from", "--set", "--warm-start", "--nproc")


def failure_text(failure: Any) -> str:
    """A worker failure's message as text (the error file nests it one level)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return message if isinstance(message, str) else ""


def root_cause(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that explains the others: a rank that raised its own error or died
    by a signal the launcher does not send, earliest first; failing that, a rank
    ended by the launcher's stop signals without a report (stopped after another
    failure, or killed from outside); failing that, the earliest peer failure (a
    collective failed because of another rank). Ties go to the lower rank. Failure
    timestamps are whole seconds, so a rank the launcher stopped in the second that
    another rank raised its error is not taken for the cause."""
    stops = {s.name for s in LAUNCHER_STOP_SIGNALS}

    def echo_level(failure: Any) -> int:
        if PEER_FAILURE_TEXT in failure_text(failure):
            return 2
        if killed_without_report(failure) and signal_name(-failure.exitcode) in stops:
            return 1
        return 0

    return min(failures.items(),
               key=lambda item: (echo_level(item[1]), item[1].timestamp, item[0]))
