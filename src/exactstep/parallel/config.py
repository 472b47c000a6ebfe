"""Configuration of multi-process training (D1-D4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """``strategy``: ``ddp`` (replicated) or ``fsdp`` (FSDP2, CUDA). World size comes
    from the launcher (torchrun), not from the configuration.

    ``timeout_s`` bounds every collective: when a peer dies or stalls, the surviving
    ranks fail with a ``DistributedError`` within this many seconds instead of hanging.
    ``bucket_mb`` is DDP's gradient bucket size.
    """

    strategy: Literal["ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_s: float = 300.0
    bucket_mb: int = 25

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s must be > 0; got {self.timeout_s}")
        if self.bucket_mb < 1:
            raise ConfigError(f"parallel.bucket_mb must be >= 1; got {self.bucket_mb}")
