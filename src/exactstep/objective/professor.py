"""The generator's Professor Forcing objective as one S / D over a whole window (Q5, L3).

A two-path batch (``families.professor.forcing``) holds, for each example, a teacher-forced
row (prompt + reference, its reference tokens supervised) and a free-running row
(prompt + a sampled continuation, nothing supervised). ``meta["professor"]`` carries
each row's path, the behaviour steps the discriminator compares and each row's
coefficient on its adversarial cost. The objective is

    S = sum_tf-tokens a_t (-log p(y_t)) + sum_rows lambda_row * c_adv(row),
    D = examples of the window (every micro-batch, every rank),

``a_t`` 1 (the sequence's summed NLL) or ``1 / n`` (its mean), ``lambda_row`` the
declared ``lambda_free`` on free rows and ``lambda_forced`` on teacher-forced ones. The
plan is made on the host before the forward: accumulation and ranks never change it,
nothing is divided twice; a window with no example is ``NoObjective``.
Design and derivations: docs/design/objective.md#objectiveprofessorpy (Q5, L3, L4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.plan import WindowPlan, supervised_mask
from exactstep.objective.policy import signal_plan
from exactstep.objective.types import NoObjective, NoObjectiveCause
from exactstep.rows.batch import Batch

FORCED, FREE = 0, 1


@dataclass(frozen=True)
class ForcingRows:
    """``meta["professor"]`` of a two-path batch of ``R`` rows: ``path`` ``[R]`` (0
    teacher-forced, 1 free-running), ``steps`` ``[R, T]`` (the behaviour columns the
    discriminator compares, in order), ``coefficient`` ``[R, T]`` float64 (``a_t`` on
    supervised columns, 0 elsewhere), ``adversarial`` ``[R]`` float64 (the row's
    coefficient on its adversarial cost), ``example`` ``[R]`` (the example's id)."""

    path: torch.Tensor
    steps: torch.Tensor
    coefficient: torch.Tensor
    adversarial: torch.Tensor
    example: torch.Tensor

    @property
    def examples(self) -> int:
        return int((self.path == FORCED).sum())


def professor_plan(*, rank: int = 0):
    """The family's plan function (``UpdateEngine(plan=)``): ``D`` = the window's
    examples (one teacher-forced row each), the NLL coefficients from the rows."""
    del rank  # D is a count every rank contributes its own share of

    def plan(batches: Sequence[Batch], cfg: ObjectiveConfig, *, allow_empty: bool = False
             ) -> WindowPlan | NoObjective:
        masks = [supervised_mask(b, m) for m, b in enumerate(batches)]
        coefficients, mb_denominators, signal = [], [], 0.0
        for b, mask in zip(batches, masks, strict=True):
            rows: ForcingRows = b.meta["professor"]
            c32 = torch.where(mask, rows.coefficient, 0.0).to(torch.float32)
            signal += math.fsum(c32.abs()[mask].tolist())
            signal += math.fsum(rows.adversarial.abs().tolist())
            coefficients.append(c32)
            mb_denominators.append(float(rows.examples))
        tokens = sum(int(m.sum()) for m in masks)
        denominator = math.fsum(mb_denominators)
        if not allow_empty and (denominator == 0.0 or tokens == 0):
            return NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)
        return signal_plan(coefficients, masks, denominator, mb_denominators, signal)

    return plan
