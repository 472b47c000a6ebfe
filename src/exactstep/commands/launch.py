"""``--nproc R`` and ``--nnodes N``: any command run as a job under torchrun (D1).

Not a command of its own: ``processes`` checks the flags before anything heavy loads,
and ``run_as_job`` starts torchrun's agent with the same command line, less the
launcher's flags, as each worker's. A worker (``WORLD_SIZE`` set) runs its command.
Design and derivations: docs/design/parallel.md#parallellaunchpy (D1, X4).
"""

from __future__ import annotations

import argparse
import os
import signal

from exactstep.errors import DistributedError, Interrupted


def processes(args: argparse.Namespace) -> int | None:
    """The processes per node that ``--nproc``/``--nnodes`` ask for, checked; None when
    neither is given (this process runs the command)."""
    nproc = getattr(args, "nproc", None)
    if nproc is not None:
        check_nproc(nproc)
    if getattr(args, "nnodes", 1) != 1 or getattr(args, "rdzv_endpoint", None):
        check_nodes(args)
        nproc = nproc or 1  # torchrun's default: one process per node
    return nproc


def check_nproc(nproc: int) -> None:
    """``--nproc R`` needs R >= 1 (D1); 0 or less is refused, never read as "one"."""
    if nproc < 1:
        raise DistributedError(f"--nproc expects a positive number of processes; got {nproc}")


def check_nodes(args: argparse.Namespace) -> None:
    """``--nnodes N`` needs N >= 1, ``0 <= --node-rank < N`` and, for N > 1,
    ``--rdzv-endpoint HOST:PORT`` (D1); refused in one line before anything runs."""
    nnodes = getattr(args, "nnodes", 1)
    if nnodes < 1:
        raise DistributedError(f"--nnodes expects a positive number of nodes; got {nnodes}")
    if not 0 <= args.node_rank < nnodes:
        raise DistributedError(f"--node-rank expects 0..{nnodes - 1} for --nnodes {nnodes}; "
                               f"got {args.node_rank}")
    endpoint = args.rdzv_endpoint
    if nnodes > 1 and not endpoint:
        raise DistributedError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's "
                               "address and a free port), the same on every node")
    host, _, port = (endpoint or "h:1").rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"--rdzv-endpoint expects HOST:PORT; got {endpoint!r}")


def run_as_job(args: argparse.Namespace, argv: list[str], nproc: int) -> int:
    """Run ``argv`` as ``nproc`` workers on this node under torchrun's agent (and on
    ``--nnodes`` nodes when given); the agent's exit code."""
    stop_on_early_sigterm()
    from exactstep.parallel.launch import (  # lazy: after the SIGTERM handler is set
        Nodes,
        relaunch,
        strip_launch_flags,
    )

    nodes = None
    if getattr(args, "nnodes", 1) > 1:
        nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                      args.rdzv_backend)
    return relaunch(strip_launch_flags(argv), nproc, nodes=nodes)


def stop_on_early_sigterm() -> None:
    """A SIGTERM to the ``--nproc`` launcher before torchrun's agent installs its own
    handlers (which forward it to the workers) ends in one line and 130, not a silent
    death: importing PyTorch alone takes seconds.

    The handler writes the line and leaves at once (``os._exit``) instead of raising:
    an exception raised in the middle of an import would leave PyTorch half-imported.
    No worker exists yet, so nothing is left behind.
    """
    def stop(signum: int, frame: object) -> None:
        os.write(2, f"error: stopped by {signal.Signals(signum).name} before the workers "
                    "started; nothing ran, run the command again\n".encode())
        os._exit(Interrupted.exit_code)

    signal.signal(signal.SIGTERM, stop)
