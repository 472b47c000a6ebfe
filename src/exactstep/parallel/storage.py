"""Storage every rank sees: the run directory must be one shared directory (D1, S3, S7).

At start, before any window, rank 0 writes a token into the run directory; every rank
reads it back and writes a probe file of its own there. A rank on another node that
sees no token (a node-local directory) or cannot write (a read-only mount) stops the
job with one ``error:`` line naming the ranks, their hosts and the fix. The job's
rank 0 alone holds the run directory's lock (``hold_run_dir``, S8).
Design and derivations: docs/design/parallel.md#parallelstoragepy (D1, S3, S7).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist

from exactstep.errors import DistributedError
from exactstep.parallel.launch import collective_guard
from exactstep.parallel.process_group import DistContext, host_group, launcher_values
from exactstep.state.durable import ensure_writable_dir, locked_directory, write_durably
from exactstep.state.manifest import MANIFEST_FILE

TOKEN_FILE = ".exactstep-shared"  # rank 0's token, removed once every rank read it


def probe_file(rank: int) -> str:
    return f".exactstep-probe-{rank:05d}"


def check_shared_run_dir(ctx: DistContext, run_dir: Path) -> None:
    """Collective (every rank calls it once, before any window): every rank sees rank 0's
    ``run_dir`` and can write there, else ``DistributedError`` on every rank (D1).

    A no-op for a single process. The token is random per call, so a directory left
    by an earlier job, or a copy of it on a node's own disk, never passes for it.
    """
    if not ctx.distributed:
        return
    run_dir = Path(run_dir)
    group = host_group(ctx)
    with collective_guard(ctx):
        token = [secrets.token_hex(16) if ctx.is_main else None]
        if ctx.is_main:
            write_durably(run_dir / TOKEN_FILE, token[0].encode())
        dist.broadcast_object_list(token, src=0, group=group)  # written before any rank reads
        mine = look(run_dir, ctx.rank, token[0])
        seen: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(seen, mine, group=group)
        if ctx.is_main:
            (run_dir / TOKEN_FILE).unlink(missing_ok=True)
    problem = storage_problem(seen, run_dir)
    if problem:
        raise DistributedError(problem)


def look(run_dir: Path, rank: int, token: str) -> dict[str, Any]:
    """What ``rank`` finds in its ``run_dir``: rank 0's ``token`` and a probe it writes."""
    found: dict[str, Any] = {"rank": rank, "host": socket.gethostname(),
                             "path": str(run_dir.resolve()), "sees": False, "writes": None}
    try:
        found["sees"] = (run_dir / TOKEN_FILE).read_text(encoding="ascii") == token
    except (OSError, UnicodeDecodeError):
        pass
    probe = run_dir / probe_file(rank)
    try:
        write_durably(probe, token.encode())
        probe.unlink()
    except OSError as exc:
        found["writes"] = exc.strerror or type(exc).__name__
    return found


def storage_problem(seen: list[dict[str, Any]], run_dir: Path) -> str | None:
    """The one message for the ranks whose storage fails (None when every rank's is
    fine): those that do not see rank 0's directory first, then those that cannot
    write in it."""
    blind = [s for s in seen if not s["sees"]]
    if blind:
        where = "; ".join(f"rank {s['rank']} on {s['host']} ({s['path']})" for s in blind)
        return (f"the run directory {run_dir} is not shared: rank 0 on {seen[0]['host']} "
                f"wrote a token in {seen[0]['path']} that {where} does not see (a "
                "node-local directory); every node needs the same run directory: put --out "
                "on a filesystem every node mounts at the same path (NFS, Lustre, ...) and "
                "give the same path on every node; nothing was written")
    mute = [s for s in seen if s["writes"] is not None]
    if mute:
        where = "; ".join(f"rank {s['rank']} on {s['host']} ({s['writes']})" for s in mute)
        return (f"the run directory {run_dir} is shared but not writable from {where}; "
                "every rank writes its checkpoint files there: mount it read-write on "
                "every node (or choose another --out)")
    return None


def hold_run_dir(path: Path, what: str, *, new: bool = False
                 ) -> contextlib.AbstractContextManager:
    """The run directory's lock for the life of this command (S8, X4; durable's
    ``locked_directory``): a second ``train``, ``resume`` or warm start into it is
    refused, naming this process, before it changes anything. Held by the job's rank 0
    (the only process, or rank 0 under torchrun; ``--nproc``'s launcher holds none),
    so the ranks of one job never lock each other out. ``new``: a start refused before
    the run's manifest was written leaves no new directory behind."""
    values = launcher_values(os.environ)
    if values is not None and values[0] != 0:
        ensure_writable_dir(path, what)
        return contextlib.nullcontext()
    return locked_directory(path, what, committed=MANIFEST_FILE if new else None)


__all__ = ["check_shared_run_dir", "hold_run_dir", "TOKEN_FILE"]
