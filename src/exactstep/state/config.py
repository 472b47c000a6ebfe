"""Configuration of checkpointing (S2-S3)."""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Publish a checkpoint every ``every`` windows (0 = only at the end) and keep
    the last ``keep`` committed ones."""

    every: int = 200
    keep: int = 2

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError("checkpoint.every must be >= 0 (0 = only at the end)")
        if self.keep < 1:
            raise ConfigError("checkpoint.keep must be >= 1")
