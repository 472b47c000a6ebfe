"""Configuration of multi-process training (D1-D4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.ranges import at_least, between, check

# Python's timedelta, which carries the timeout to the collectives, overflows past
# ~8.6e13 s; 1e9 s (about 31 years) is a round bound far below that.
MAX_TIMEOUT_S = 1e9


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """``strategy``: ``ddp`` (replicated) or ``fsdp`` (FSDP2 ``fully_shard`` per decoder
    layer, built-in and HF models; gloo on CPU, NCCL on CUDA; one process runs
    unsharded). World size comes from the launcher (torchrun), not from the
    configuration.

    ``timeout_s`` bounds every collective: when a peer dies or stalls, the surviving
    ranks fail with a ``DistributedError`` within this many seconds instead of hanging.
    ``bucket_mb`` is DDP's gradient bucket size.

    ``tp``, ``pp``, ``cp``: ranks a replica is split into by tensor, pipeline and
    context (sequence) parallelism; the data-parallel size is what is left of the world
    (``dp = world / (tp * pp * cp)``, ``parallel.layout``). ``schedule`` is the
    pipeline schedule (``pp > 1`` only).
    """

    strategy: Literal["ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 300.0
    bucket_mb: int = 25
    tp: int = 1
    pp: int = 1
    cp: int = 1
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"

    def __post_init__(self) -> None:
        check("parallel.timeout_s", self.timeout_s, between(0, MAX_TIMEOUT_S, low_open=True))
        check("parallel.bucket_mb", self.bucket_mb, at_least(1))
        for axis in ("tp", "pp", "cp"):
            check(f"parallel.{axis}", getattr(self, axis), at_least(1))
