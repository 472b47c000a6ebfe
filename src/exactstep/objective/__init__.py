"""The objective stage: rows to one objective ``S / D`` (L1-L6).

``plan_window`` gives a window's host-side coefficients and denominator, or
``NoObjective`` (L3, L4); ``microbatch_terms`` one microbatch's numerator and gold NLL
sum, the head fused into a chunked fp32 cross entropy (L1, L2); ``fused_row_losses`` /
``logits_row_losses`` per-row smoothed CE and gold NLL; ``perplexity`` a value from
globally reduced sums or ``NotAvailable`` (L5); ``reference`` a pure-Python oracle (L6).
Design and derivations: docs/design/objective.md (L1-L6).
"""

from exactstep.lazy import lazy_exports

# ``perplexity`` is also the name of its module: bound eagerly (the module is light),
# since importing the submodule would otherwise shadow a lazily exported function.
from exactstep.objective.perplexity import perplexity as perplexity

_EXPORTS = {
    "NoObjective": "exactstep.objective.types",
    "NoObjectiveCause": "exactstep.objective.types",
    "NotAvailable": "exactstep.objective.perplexity",
    "ObjectiveConfig": "exactstep.objective.config",
    "Smoothing": "exactstep.objective.smoothing",
    "WindowPlan": "exactstep.objective.plan",
    "fused_row_losses": "exactstep.objective.cross_entropy",
    "fused_weighted_sum": "exactstep.objective.cross_entropy",
    "logits_microbatch_terms": "exactstep.objective.terms",
    "logits_row_losses": "exactstep.objective.cross_entropy",
    "mean_loss": "exactstep.objective.perplexity",
    "microbatch_terms": "exactstep.objective.terms",
    "no_objective": "exactstep.objective.plan",
    "plan_window": "exactstep.objective.plan",
    "target_distribution": "exactstep.objective.smoothing",
}

_NAMES, __getattr__, _dir = lazy_exports(__name__, _EXPORTS)
__all__ = sorted([*_NAMES, "perplexity"])


def __dir__() -> list[str]:
    return __all__
