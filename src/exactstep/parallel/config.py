"""Configuration of multi-process training (D1-D4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """``strategy``: ``ddp`` (replicated) or ``fsdp`` (FSDP2, CUDA). World size comes
    from the launcher (torchrun), not from the configuration."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
