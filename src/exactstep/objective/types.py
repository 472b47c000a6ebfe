"""The no-objective value at the seam between the objective and update stages (L4).

A window with an objective is described by its ``WindowPlan`` (host coefficients and
D, L3) and each microbatch's terms; ``NoObjective`` is what a window with ``D == 0`` is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NoObjectiveCause(enum.StrEnum):
    """Why a window (or microbatch) has no objective (L4)."""

    EMPTY_ELIGIBLE_SET = "EMPTY_ELIGIBLE_SET"  # no supervised row at all
    NONEMPTY_ZERO_WEIGHT_MASS = "NONEMPTY_ZERO_WEIGHT_MASS"  # rows exist, weights sum to 0
    ZERO_ADVANTAGE = "ZERO_ADVANTAGE"  # D > 0 but every coefficient is 0 (policy, Q4)


@dataclass(frozen=True)
class NoObjective:
    """``D == 0``: a value, never a NaN and never a zero loss (L4)."""

    cause: NoObjectiveCause
