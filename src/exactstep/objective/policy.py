"""The policy objective as S / D over a whole window (Q4, L3, L4).

A trajectory batch's scored rows carry coefficients ``c_r`` (``meta["policy"]``): 1
for a teacher-forced token, the advantage (and k3's term) for a sampled one. With
``loss_r = -log pi(y_r)`` the objective is ``S / D = sum_r a_r loss_r / D``:

- ``token_mean``: ``a_r = c_r``, ``D`` = scored tokens of the window (every
  micro-batch, every rank: the engine sums ``D`` over ranks before any forward);
- ``sequence_mean``: ``a_r = c_r / n_i`` (``n_i`` the trajectory's scored tokens),
  ``D`` = trajectories of the window;
- ``constant``: ``a_r = c_r``, ``D`` = the declared constant (rank 0 brings it).

The plan is made on the host before the forward, so accumulation and ranks never
change it and nothing is divided twice; a window whose every coefficient is zero is
``NoObjective`` (``ZERO_ADVANTAGE``), one with nothing scored ``EMPTY_ELIGIBLE_SET``.
Design and derivations: docs/design/objective.md#objectivepolicypy (Q4, L3, L4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.plan import WindowPlan, no_objective, supervised_mask
from exactstep.objective.types import NoObjective, NoObjectiveCause
from exactstep.rows.batch import Batch


@dataclass(frozen=True)
class PolicyRows:
    """``meta["policy"]`` of a trajectory batch, ``[B, T]`` each: ``coefficient``
    (float64, 0 where not scored), ``trajectory`` (the row's trajectory index within the
    micro-batch, -1 where not scored), ``sampled`` (scored rows drawn from the model),
    ``old_logprob`` (float64: the sampler's ``log pi_old`` of each sampled row, 0
    elsewhere; recorded for a window trained by several clipped steps, else None)."""

    coefficient: torch.Tensor
    trajectory: torch.Tensor
    sampled: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    old_logprob: torch.Tensor | None = None

    @staticmethod
    def empty(shape: tuple[int, int]) -> PolicyRows:
        return PolicyRows(torch.zeros(shape, dtype=torch.float64),
                          torch.full(shape, -1, dtype=torch.int64),
                          torch.zeros(shape, dtype=torch.bool))


@dataclass(frozen=True)
class PolicyPlan(WindowPlan):
    """A ``WindowPlan`` that also reports ``signal = sum |a_r|``: the engine decides L4
    on it too (every advantage zero is no objective, not a zero step)."""

    signal: float = 0.0


def policy_plan(normalizer: str, constant: float, *, rank: int = 0):
    """The family's plan function (``UpdateEngine(plan=)``) for ``normalizer``."""

    def plan(batches: Sequence[Batch], cfg: ObjectiveConfig, *, allow_empty: bool = False
             ) -> PolicyPlan | NoObjective:
        masks = [supervised_mask(b, m) for m, b in enumerate(batches)]
        coefficients, mb_denominators, signal = [], [], 0.0
        trajectories = 0
        for b, mask in zip(batches, masks, strict=True):
            rows: PolicyRows = b.meta["policy"]
            c = torch.where(mask, rows.coefficient, 0.0)  # [B, T] float64
            if normalizer == "sequence_mean":
                ids = torch.where(mask, rows.trajectory, -1)
                present = ids[mask].unique()
                trajectories += int(present.numel())
                lengths = torch.zeros(max(int(ids.max()) + 1, 1), dtype=torch.float64)
                lengths.index_add_(0, ids[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
                c = torch.where(mask, c / lengths[ids.clamp(min=0)], 0.0)
                mb_denominators.append(float(present.numel()))
            else:
                mb_denominators.append(float(mask.sum()))
            c32 = c.to(torch.float32)  # what the engine multiplies by: the signal is its
            signal += math.fsum(c32.abs()[mask].tolist())
            coefficients.append(c32)
        tokens = sum(int(m.sum()) for m in masks)
        if normalizer == "token_mean":
            denominator = float(tokens)
        elif normalizer == "sequence_mean":
            denominator = float(trajectories)
        else:  # one declared constant for the window: rank 0 brings it to the sum
            denominator = constant if rank == 0 else 0.0
        if not allow_empty:
            if tokens == 0:
                return NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)
            decision = no_objective(denominator, tokens)
            if decision is not None:
                return decision
            if signal == 0.0:
                return NoObjective(NoObjectiveCause.ZERO_ADVANTAGE)
        return signal_plan(coefficients, masks, denominator, mb_denominators, signal)

    return plan


def signal_plan(coefficients: list[torch.Tensor], masks: list[torch.Tensor],
                denominator: float, microbatch_denominators: list[float], signal: float
                ) -> PolicyPlan:
    """The plan of a window whose per-micro-batch coefficients and supervised masks are
    known: the rows' flat indices and counts from the masks."""
    return PolicyPlan(
        coefficients=coefficients, denominator=denominator,
        tokens=sum(int(m.sum()) for m in masks),
        microbatch_denominators=microbatch_denominators,
        row_indices=[m.reshape(-1).nonzero().squeeze(1) for m in masks],
        microbatch_tokens=[int(m.sum()) for m in masks], signal=signal)
