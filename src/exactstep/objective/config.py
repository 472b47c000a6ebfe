"""Configuration of the objective stage (L1-L5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.ranges import UNIT, at_least, check


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """How row losses become one objective S / D.

    ``family``: the objective family (R8; ``exactstep.families``): which compiler
    turns examples into rows and which model trains on them. ``auto`` is ``chat``
    when ``data.kind = "chat"``, else ``causal``. ``reduction``: L3 reductions. ``smoothing``/``label_smoothing``: L2 convention and
    eps. ``chunk_rows``: rows per cross-entropy chunk (L1); 0 = unchunked.
    """

    family: Literal[
        "auto", "causal", "chat", "prefix", "encdec", "mlm", "span", "permutation",
        "scheduled_sampling", "policy", "mass", "bart", "professor",
    ] = "auto"
    reduction: Literal[
        "token_mean", "sequence_mean", "microbatch_mean", "weighted", "weighted_count"
    ] = "token_mean"
    smoothing: Literal["uniform", "non_pad", "harvard"] = "uniform"
    label_smoothing: float = 0.0
    chunk_rows: int = 1024

    def __post_init__(self) -> None:
        check("objective.label_smoothing", self.label_smoothing, UNIT)
        check("objective.chunk_rows", self.chunk_rows, at_least(0))  # 0 = unchunked
