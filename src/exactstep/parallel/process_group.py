"""Process groups: who am I, how many are we, and what happens when a peer dies (D1).

Reads torchrun's variables (none: a single process, no group); forms the default
group for gradients and a ``gloo`` host group for host values and barriers, both
bounded by ``parallel.timeout_s``, so a dead or stalled peer raises instead of
hanging; and leaves a rank record the launcher reads when a worker dies silently.
Design and derivations: docs/design/parallel.md#parallelprocess_grouppy (D1).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from exactstep.errors import DistributedError
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.layout import (
    Layout,
    build_layout,
    check_built,
    layout_sizes,
    single_layout,
)

LAUNCHER_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"  # set by torchrun for each worker
RANK_RECORD_FILE = "exactstep-rank.json"  # written beside the error file


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job. ``backend`` is ``None`` for a single process.

    ``host_group`` is the ``gloo`` group for host values and barriers (None for a
    single process, or for a context made by hand: ``host_group()`` then falls back
    to the default group under ``gloo``); ``timeout_s`` bounds both groups.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    host_group: Any = field(default=None, compare=False, repr=False)
    timeout_s: float | None = None
    layout: Layout | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.layout is None:  # by hand: every rank a whole replica
            object.__setattr__(self, "layout", Layout(dp=self.world_size, rank=self.rank))

    @property
    def is_main(self) -> bool:
        """Rank 0 owns the progress bar, the ledger, metrics and published files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def single_process(device: torch.device) -> DistContext:
    """The world-1 context: no process group, rank 0."""
    return DistContext(rank=0, world_size=1, local_rank=0, device=device, backend=None,
                       layout=single_layout())


def launcher_values(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, world, local_rank) from the launcher's variables, or None when absent."""
    if "WORLD_SIZE" not in env or "RANK" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise DistributedError(
            "RANK / WORLD_SIZE / LOCAL_RANK must be integers (they are set by torchrun); "
            f"got RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r}"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise DistributedError(f"rank {rank} is outside a world of {world}; relaunch with torchrun")
    return rank, world, local


def resolve_backend(cfg: ParallelConfig, device_type: str) -> str:
    """``auto`` -> nccl on CUDA, gloo on CPU. nccl without CUDA is a user error."""
    if cfg.backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if cfg.backend == "nccl" and device_type != "cuda":
        raise DistributedError(
            "parallel.backend = 'nccl' needs CUDA devices; use parallel.backend = 'gloo' "
            "(or 'auto') on CPU"
        )
    return cfg.backend


def resolve_rank_device(device_pref: str | torch.device, local_rank: int) -> torch.device:
    """CPU stays CPU; CUDA means ``cuda:LOCAL_RANK`` (one device per process)."""
    if str(device_pref) == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        kind = torch.device(device_pref).type
    if kind != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedError("device 'cuda' was asked for but no CUDA device is visible")
    if local_rank >= torch.cuda.device_count():
        raise DistributedError(
            f"local rank {local_rank} has no CUDA device ({torch.cuda.device_count()} visible); "
            "use --nproc_per_node <= the number of devices"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_distributed(
    cfg: ParallelConfig,
    device_pref: str | torch.device,
    *,
    env: Mapping[str, str] | None = None,
) -> DistContext:
    """Join the job described by the launcher's variables (``env``: default the process's).

    The variables are torchrun's: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``. Returns a world-1 context (no process group)
    when they are absent or ``WORLD_SIZE=1``; otherwise forms the default group and
    the ``gloo`` host group, both bounded by ``parallel.timeout_s``. Raises
    ``DistributedError`` naming the rendezvous address when the group cannot form.
    """
    env = os.environ if env is None else env
    values = launcher_values(env)
    world = 1 if values is None else values[1]
    sizes = layout_sizes(world, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)  # refused before joining
    check_built(sizes)
    if values is None or values[1] == 1:
        local = values[2] if values else 0
        return single_process(resolve_rank_device(device_pref, local))
    rank, world, local = values
    device = resolve_rank_device(device_pref, local)
    backend = resolve_backend(cfg, device.type)
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), env.get("MASTER_PORT")
    if port is None:
        raise DistributedError("MASTER_PORT is not set; launch with torchrun (it sets it)")
    timeout = timedelta(seconds=cfg.timeout_s)
    refusal = shared_store_restarts(env)
    if refusal is not None:  # before any store key is written or any window runs (S10)
        raise SharedStoreRestarts(
            refusal, repeated=rank == 0 and refused_before(addr, int(port), timeout))
    try:
        dist.init_process_group(
            backend=backend,
            store=attempt_store(addr, int(port), rank, world, timeout, env),
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        host = new_host_group(timeout)
        layout = build_layout(sizes, rank, device.type, backend, timeout, host)
    except (RuntimeError, ValueError) as exc:
        raise DistributedError(
            f"rank {rank} of {world} could not join the process group at {addr}:{port} "
            f"with backend {backend} within {cfg.timeout_s:g} s ({_first_line(exc)}); check "
            "that every rank was started and that the address is reachable"
        ) from None
    ctx = DistContext(rank=rank, world_size=world, local_rank=local, device=device,
                      backend=backend, host_group=host, timeout_s=cfg.timeout_s, layout=layout)
    write_rank_record(ctx, env)
    return ctx


def attempt_store(addr: str, port: int, rank: int, world: int, timeout: timedelta,
                  env: Mapping[str, str]) -> dist.Store:
    """The store the group forms over, as ``tcp://addr:port`` would make it: rank 0
    hosts it, or torchrun's agent does. The agent keeps its store across
    ``--max-restarts`` restarts, where a restarted rank would read the dead attempt's
    addresses and fail to connect (pytorch/pytorch#135712), so there each attempt's
    keys live under their own prefix (S10). The agents of several nodes may count
    restarts differently, so there ``init_distributed`` refuses a shared store under
    restarts (``shared_store_restarts``); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    gives every attempt a fresh store instead (docs/design/parallel.md#resume-auto)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout,
                             multi_tenant=True)
    store = dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"exactstep/attempt-{attempt}", store)


SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"  # "1": a fresh store every round
REFUSED_KEY = "exactstep/refused-shared-store-restarts"


class SharedStoreRestarts(DistributedError):
    """A multi-node job under ``--max-restarts`` whose workers would share the agents'
    store across restarts (``shared_store_restarts``). ``repeated``: an earlier attempt
    of the same job was refused already and printed the line (torchrun restarts a
    refused worker group like a failed one), so this one only records it."""

    def __init__(self, message: str, *, repeated: bool = False) -> None:
        super().__init__(message)
        self.repeated = repeated


def shared_store_restarts(env: Mapping[str, str]) -> str | None:
    """Why this worker must not start, or None (S10, D1).

    torchrun's agents keep one store for every ``--max-restarts`` restart
    (``TORCHELASTIC_USE_AGENT_STORE=True``), and ``attempt_store`` keeps the attempts
    apart by ``TORCHELASTIC_RESTART_COUNT``. On several nodes (``GROUP_WORLD_SIZE``
    > 1) that count is each agent's own: an agent counts a restart only when its own
    workers failed, and restarts uncounted when another node rejoins while its
    workers still run, so the ranks of one attempt can pick different prefixes and
    a restarted rank reads a dead attempt's addresses or waits for keys written under
    another prefix. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives every rendezvous
    round a fresh store hosted by its rank 0 (c10d; the static rendezvous ignores
    it), as ``exactstep train --nnodes`` sets it."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    if nodes < 2 or restarts < 1:
        return None
    if env.get(SHARE_STORE_VAR) == "1":  # set, yet shared: a rendezvous that ignores it
        fix = f"keep {SHARE_STORE_VAR}=1 and use --rdzv-backend c10d (static ignores it)"
    else:
        fix = (f"export {SHARE_STORE_VAR}=1 on every node before torchrun (every restart "
               "then forms over a fresh store)")
    return (f"torchrun --max-restarts {restarts} on {nodes} nodes: the workers would form "
            "over one store kept across restarts, and the nodes count restarts apart, so a "
            "restarted rank could read a dead attempt's addresses and never join; "
            f"{fix}, or use --max-restarts 0 and run the same train command with "
            "--resume auto again; nothing was run")


def refused_before(addr: str, port: int, timeout: timedelta) -> bool:
    """Whether an earlier attempt of this job was refused already: a counter in the
    agents' store (``addr:port``), which outlives the attempts. False when that store
    cannot be reached (the line is then printed again rather than never)."""
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        return int(store.add(REFUSED_KEY, 1)) > 1
    except (RuntimeError, ValueError, OSError):
        return False


def new_host_group(timeout: timedelta):
    """A ``gloo`` group over every rank with the job's ``timeout`` (collective: every
    rank calls it once, right after the default group formed). Without an explicit
    timeout ``new_group`` would wait 30 minutes for a stalled peer."""
    return dist.new_group(backend="gloo", timeout=timeout)


def host_group(ctx: DistContext):
    """The group that reduces host tensors and runs barriers for ``ctx``: the ``gloo``
    host group under every backend, so a CPU job tests the path a CUDA job runs."""
    if ctx.host_group is not None:
        return ctx.host_group
    if ctx.backend == "gloo":
        return dist.group.WORLD
    raise DistributedError(
        f"rank {ctx.rank}: no host (gloo) process group; join the job with init_distributed"
    )


def write_rank_record(ctx: DistContext, env: Mapping[str, str]) -> None:
    """Under torchrun: what this rank runs on, beside its error file (read by the
    launcher only when the worker dies without reporting)."""
    path = env.get(ERROR_FILE_VAR)
    if not path:
        return
    record = {"rank": ctx.rank, "world_size": ctx.world_size, "layout": ctx.layout.coords(),
              "backend": ctx.backend,
              "device": str(ctx.device), "timeout_s": ctx.timeout_s}
    try:
        (Path(path).parent / RANK_RECORD_FILE).write_text(json.dumps(record))
    except OSError:
        pass  # a missing record only makes the launcher's message less specific


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (a no-op for a single process or when already gone)."""
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()


class PeerFailure(DistributedError):
    """A collective failed because another rank died or stalled: a consequence, not
    the root cause. Under a launcher the launcher names the root cause instead."""


PEER_FAILURE_TEXT = "a collective failed"


PEER_TIMEOUT_TEXT = "no answer within"
TIMEOUT_MARKERS = ("timed out", "timeout")


def peer_failure(ctx: DistContext, exc: BaseException) -> DistributedError:
    """Translate a failed collective into the one message a user sees (D1).

    A timeout (the peer is alive but silent: it stalled) says so and names the bound
    (``parallel.timeout_s``); a closed connection (the peer died) does not.
    """
    cause = _first_line(exc)
    waited = ""
    if any(marker in cause.lower() for marker in TIMEOUT_MARKERS):
        bound = f"{ctx.timeout_s:g} s" if ctx.timeout_s is not None else "the timeout"
        waited = f"; {PEER_TIMEOUT_TEXT} {bound} (parallel.timeout_s)"
    return PeerFailure(
        f"rank {ctx.rank} of {ctx.world_size}: {PEER_FAILURE_TEXT} ({cause}){waited}; "
        "another rank probably died or stalled — see the first failing rank's message, "
        "then resume from the last committed checkpoint"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def launcher_env(rank: int, world: int, port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """The variables torchrun would set for ``rank`` of ``world`` on one host."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": host, "MASTER_PORT": str(port)}
