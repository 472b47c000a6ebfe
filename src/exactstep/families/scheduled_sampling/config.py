"""The ``[scheduled_sampling]`` section (R8): the declared schedule of the gold-input
probability and the family it samples over. Light (no torch at import), so the run
configuration can be read without loading the training stack; the estimator itself
is ``inputs.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from exactstep.ranges import UNIT, at_least, between, check


@dataclass(frozen=True, kw_only=True)
class ScheduledSamplingConfig:
    """The declared schedule of the gold-input probability (``gold_probability``), and the
    family it samples over: ``over = "causal"`` (the built-in decoder on text) or
    ``"encdec"`` (the encoder-decoder on pairs; the decoder side's inputs are the
    ones replaced, the source is never touched)."""

    over: Literal["causal", "encdec"] = "causal"
    schedule: Literal["inverse_sigmoid", "linear", "exponential", "constant"] = \
        "inverse_sigmoid"
    k: float = 100.0
    slope: float = 0.001
    base: float = 0.999
    probability: float = 1.0
    floor: float = 0.0

    def __post_init__(self) -> None:
        check("scheduled_sampling.k", self.k, at_least(1.0))
        check("scheduled_sampling.slope", self.slope, at_least(0.0))
        check("scheduled_sampling.base", self.base, between(0, 1, low_open=True))
        check("scheduled_sampling.probability", self.probability, UNIT)
        check("scheduled_sampling.floor", self.floor, UNIT)

    def gold_probability(self, clock: int) -> float:
        """``eps(clock)``: the probability that an eligible input is the gold token.

        ``inverse_sigmoid``: ``k / (k + exp(clock / k))``; ``linear``: ``1 - slope *
        clock``; ``exponential``: ``base ** clock``; ``constant``: ``probability``;
        then clamped to ``[floor, 1]``. ``clock`` counts committed windows only.
        """
        if self.schedule == "inverse_sigmoid":
            exponent = clock / self.k
            eps = 0.0 if exponent > 700 else self.k / (self.k + math.exp(exponent))
        elif self.schedule == "linear":
            eps = 1.0 - self.slope * clock
        elif self.schedule == "exponential":
            eps = self.base ** clock
        else:
            eps = self.probability
        return min(1.0, max(self.floor, eps))

    def describe(self) -> dict:
        """The manifest's record of the estimator (S1)."""
        return {"over": self.over, "schedule": self.schedule, "k": self.k, "slope": self.slope, "base": self.base,
                "probability": self.probability, "floor": self.floor,
                "clock": "committed_windows", "model_token": "argmax",
                "construction": "sequential"}
