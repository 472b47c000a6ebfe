"""How a window ended (U4): exactly one disposition, one ledger line."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class Outcome(enum.StrEnum):
    COMMITTED = "COMMITTED"
    SKIPPED_NONFINITE = "SKIPPED_NONFINITE"
    NO_OBJECTIVE = "NO_OBJECTIVE"


@dataclass(frozen=True)
class Disposition:
    """One window's result.

    ``lr`` is the learning rate the optimizer actually used (None unless committed);
    ``denominator`` is the window's D; ``loss`` is the window's objective S / D
    (None when there is none); ``grad_norm`` is the global norm before clipping;
    ``tokens`` counts supervised rows; ``gold_nll_sum`` feeds perplexity (L5).
    """

    window: int
    outcome: Outcome
    cause: str | None
    lr: float | None
    denominator: float
    loss: float | None
    grad_norm: float | None
    tokens: int
    gold_nll_sum: float = 0.0
    microbatches: int = 0

    def ledger_record(self) -> dict:
        """The U4 ledger line. Non-finite floats are written as strings, JSON stays valid."""

        def num(x: float | None) -> float | str | None:
            if x is None or math.isfinite(x):
                return x
            return str(x)

        return {
            "window": self.window,
            "disposition": self.outcome.value,
            "cause": self.cause,
            "lr": num(self.lr),
            "D": num(self.denominator),
            "loss": num(self.loss),
            "grad_norm": num(self.grad_norm),
            "tokens": self.tokens,
            "microbatches": self.microbatches,
        }
