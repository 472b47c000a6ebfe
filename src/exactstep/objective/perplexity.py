"""Perplexity from globally reduced sums (L5).

``perplexity = exp(sum gold NLL / sum tokens)``, where both sums are reduced over
every batch (and every rank) *before* the exponential. Averaging per-batch losses or
per-batch perplexities is a different, wrong quantity (batches weigh tokens unequally;
the exponential does not commute with the mean). The NLL is the gold (unsmoothed) one
(L2), never the smoothed training loss.

When no number exists the result is ``NotAvailable(cause)``: ``NO_TOKENS`` (nothing
was scored), ``OVERFLOW`` (the mean NLL is finite or +inf but ``exp`` exceeds the
float range) or ``NON_FINITE`` (the NLL sum is NaN, or negative infinity).
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

    Raises ``ObjectiveError`` for a negative token count (a caller bug upstream).
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
