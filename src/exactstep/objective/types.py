"""Objective values at the seam between the objective and update stages (L3, L4)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class NoObjectiveCause(enum.StrEnum):
    """Why a window (or microbatch) has no objective (L4)."""

    EMPTY_ELIGIBLE_SET = "EMPTY_ELIGIBLE_SET"  # no supervised row at all
    NONEMPTY_ZERO_WEIGHT_MASS = "NONEMPTY_ZERO_WEIGHT_MASS"  # rows exist, weights sum to 0


@dataclass(frozen=True)
class Objective:
    """One microbatch's share of ``S / D`` (L3).

    ``numerator`` is ``sum a_r * c_r`` (graph-connected, 0-dim, fp32);
    ``denominator`` is ``sum b_r`` (a host float: it is known before the forward);
    ``gold_nll_sum`` is the detached unsmoothed NLL sum and ``tokens`` the number of
    supervised rows, both for reporting and perplexity (L5).
    """

    numerator: torch.Tensor
    denominator: float
    gold_nll_sum: torch.Tensor
    tokens: int


@dataclass(frozen=True)
class NoObjective:
    """``D == 0``: a value, never a NaN and never a zero loss (L4)."""

    cause: NoObjectiveCause
