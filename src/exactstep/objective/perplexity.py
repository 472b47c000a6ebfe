"""Perplexity from globally reduced sums (L5).

``perplexity`` exponentiates the gold (unsmoothed, L2) NLL per token only after both
sums are reduced over every batch and rank, and returns ``NotAvailable(cause)`` when
no number exists; evaluation and the run's reports read it.
Design and derivations: docs/design/objective.md#objectiveperplexitypy (L5, L2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exactstep.errors import ObjectiveError


@dataclass(frozen=True)
class NotAvailable:
    """A perplexity that does not exist, with its cause (L5)."""

    cause: str  # "NO_TOKENS" | "OVERFLOW" | "NON_FINITE"

    def __str__(self) -> str:
        return f"N/A ({self.cause})"


def perplexity(gold_nll_sum: float, tokens: int) -> float | NotAvailable:
    """``exp(gold_nll_sum / tokens)`` of globally reduced sums, or ``NotAvailable`` (L5).

    Both sums must already be reduced over every batch and rank (averaging per-batch
    losses or perplexities is wrong), and the NLL is the gold, unsmoothed one (L2).
    ``NO_TOKENS`` for zero tokens, ``NON_FINITE`` for a NaN or -inf sum, ``OVERFLOW``
    when ``exp`` of the mean leaves the float range. Raises ``ObjectiveError`` for a negative token count (a caller bug upstream).
    """
    if tokens < 0:
        raise ObjectiveError(f"perplexity needs a token count >= 0; got {tokens}")
    if tokens == 0:
        return NotAvailable("NO_TOKENS")
    nll = float(gold_nll_sum)
    if math.isnan(nll) or nll == -math.inf:
        return NotAvailable("NON_FINITE")
    mean = nll / tokens
    try:
        value = math.exp(mean)
    except OverflowError:
        return NotAvailable("OVERFLOW")
    if math.isinf(value):
        return NotAvailable("OVERFLOW")
    return value


def mean_loss(loss_sum: float, tokens: int) -> float | NotAvailable:
    """``loss_sum / tokens`` of globally reduced sums, or ``NotAvailable("NO_TOKENS")``."""
    if tokens <= 0:
        return NotAvailable("NO_TOKENS")
    return float(loss_sum) / tokens
