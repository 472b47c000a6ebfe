"""The objective stage: rows to one objective ``S / D`` (L1-L6).

- ``plan_window``: host-side coefficients and denominator of a window, or
  ``NoObjective`` (L3, L4).
- ``microbatch_terms``: one microbatch's numerator and gold NLL sum, with the head
  projection fused into a chunked fp32 cross entropy (L1, L2).
- ``fused_row_losses`` / ``logits_row_losses``: per-row smoothed CE and gold NLL.
- ``perplexity``: from globally reduced sums, or ``NotAvailable`` (L5).
- ``reference``: a pure-Python oracle for tests (L6).
"""

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.cross_entropy import (
    fused_row_losses,
    fused_weighted_sum,
    logits_row_losses,
)
from exactstep.objective.perplexity import NotAvailable, mean_loss, perplexity
from exactstep.objective.plan import WindowPlan, no_objective, plan_window
from exactstep.objective.smoothing import Smoothing, target_distribution
from exactstep.objective.terms import logits_microbatch_terms, microbatch_terms
from exactstep.objective.types import NoObjective, NoObjectiveCause, Objective

__all__ = [
    "NoObjective",
    "NoObjectiveCause",
    "NotAvailable",
    "Objective",
    "ObjectiveConfig",
    "Smoothing",
    "WindowPlan",
    "fused_row_losses",
    "fused_weighted_sum",
    "logits_microbatch_terms",
    "logits_row_losses",
    "mean_loss",
    "microbatch_terms",
    "no_objective",
    "perplexity",
    "plan_window",
    "target_distribution",
]
