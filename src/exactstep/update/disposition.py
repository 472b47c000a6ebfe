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
    ``denominator`` is the window's D; ``loss`` is the window's optimized objective
    S / D (smoothed, under the declared reduction; None when there is none);
    ``grad_norm`` is the global norm before clipping; ``tokens`` counts the window's
    supervised target tokens (all ranks); ``gold_nll_sum`` is the unsmoothed NLL summed
    over those same tokens (all ranks), which feeds ``gold_loss`` and perplexity (L2, L5).
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
    inputs: dict | None = None  # what an input program did (scheduled sampling, R8)
    steps: tuple[dict, ...] | None = None  # each optimizer step of a window of several

    @property
    def gold_loss(self) -> float | None:
        """Gold (unsmoothed) NLL per supervised target token: ``gold_nll_sum / tokens`` (L2).

        The denominator is always ``tokens``, the window's supervised target tokens,
        whatever the reduction: it is neither ``D`` nor weighted. So under
        ``token_mean`` without smoothing ``gold_loss == loss`` bit for bit (both are the
        same sum over the same rows divided by the same count); with smoothing the two
        differ by the smoothing term; under ``sequence_mean`` or ``weighted*`` ``loss``
        averages differently while ``gold_loss`` stays a token mean. None when no
        forward ran (``NO_OBJECTIVE``) or the window has no supervised token. For
        interval metrics sum ``gold_nll_sum`` and ``tokens`` over windows and divide
        once (L5), never average ``gold_loss`` values.
        """
        if self.outcome is Outcome.NO_OBJECTIVE or self.tokens == 0:
            return None
        return self.gold_nll_sum / self.tokens

    def ledger_record(self) -> dict:
        """The U4 ledger line. Non-finite floats are written as strings, JSON stays valid.

        ``loss`` is the optimized objective S / D; ``gold_nll`` beside it is
        ``gold_loss``, the unsmoothed NLL per supervised target token (L2). A window
        whose inputs an input program rewrote (R8) also records ``inputs``: the gold
        input probability and how many inputs were the model's. A window trained by
        several optimizer steps (one transaction) lists each in ``steps``.
        """

        def num(x: float | None) -> float | str | None:
            if x is None or math.isfinite(x):
                return x
            return str(x)

        record = {
            "window": self.window,
            "disposition": self.outcome.value,
            "cause": self.cause,
            "lr": num(self.lr),
            "D": num(self.denominator),
            "loss": num(self.loss),
            "gold_nll": num(self.gold_loss),
            "grad_norm": num(self.grad_norm),
            "tokens": self.tokens,
            "microbatches": self.microbatches,
        }
        if self.inputs is not None:
            record["inputs"] = self.inputs
        if self.steps is not None:  # a window of several optimizer steps: each one's
            record["steps"] = [{k: num(v) if isinstance(v, float) else v
                                for k, v in step.items()} for step in self.steps]
        return record
