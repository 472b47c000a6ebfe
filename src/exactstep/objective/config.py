"""Configuration of the objective stage (L1-L5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """How row losses become one objective S / D.

    ``reduction``: L3 reductions. ``smoothing``/``label_smoothing``: L2 convention and
    eps. ``chunk_rows``: rows per cross-entropy chunk (L1); 0 = unchunked.
    """

    reduction: Literal[
        "token_mean", "sequence_mean", "microbatch_mean", "weighted", "weighted_count"
    ] = "token_mean"
    smoothing: Literal["uniform", "non_pad", "harvard"] = "uniform"
    label_smoothing: float = 0.0
    chunk_rows: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ConfigError(
                f"objective.label_smoothing must be in [0, 1]; got {self.label_smoothing}"
            )
        if self.chunk_rows < 0:
            raise ConfigError("objective.chunk_rows must be >= 0 (0 = unchunked)")
