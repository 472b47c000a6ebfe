"""Several clipped optimizer steps per rollout batch: PPO/GRPO's epochs (Q1, Q4, U3, U4).

``ClippedRollouts`` is the rollout program of a policy run with ``policy.epochs > 1``.
The window's rollouts are drawn once, at the parameters before its first step (Q1);
each sampled token's float64 log-probability from the sampler is ``log pi_old``, kept
in the batch and written to the rollouts journal. The first step trains the rollouts'
own coefficients: it is on-policy, ``rho = 1`` exactly, the REINFORCE window's step.
Each next step (the engine's ``next_pass``) recomputes every sampled token's ``log pi``
at that step's parameters and turns its coefficient ``A`` into the gradient of
``-min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``: ``A * rho`` where the unclipped
branch is the min, 0 where the clipped one is. D stays the window's (Q4).
Design and derivations: docs/design/families.md#familiespolicyclippedpy (Q1, Q4, U3, U4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.objective.policy import PolicyRows
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.transfer import batch_to_device
from exactstep.state.rng import isolated

#: Scored rows whose log-probabilities are computed per head product (memory: rows x V).
CHUNK_ROWS = 512


def clipped_coefficients(coefficient: torch.Tensor, logprob: torch.Tensor,
                         old_logprob: torch.Tensor, sampled: torch.Tensor, *, low: float,
                         high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(coefficient', rho, clipped)`` ``[B, T]`` (float64, float64, bool).

    For a sampled row with advantage coefficient ``A`` and ``rho = exp(log pi -
    log pi_old)``, the clipped surrogate ``-min(rho A, clip(rho, 1 - low, 1 + high) A)``
    has gradient ``A * rho`` times that of ``-log pi`` when its unclipped branch is the
    min (``A > 0`` and ``rho <= 1 + high``, or ``A < 0`` and ``rho >= 1 - low``; a tie
    keeps the gradient), else 0. Rows not sampled keep their coefficient."""
    rho = torch.where(sampled, torch.exp(logprob - old_logprob), 1.0)
    unclipped = torch.where(coefficient > 0, rho <= 1.0 + high,
                            torch.where(coefficient < 0, rho >= 1.0 - low, True))
    out = torch.where(sampled, torch.where(unclipped, coefficient * rho, 0.0), coefficient)
    return out, rho, sampled & ~unclipped


@torch.no_grad()
def sampled_logprobs(model: torch.nn.Module, batch: Batch, sampled: torch.Tensor,
                     device: torch.device) -> torch.Tensor:
    """``log pi`` ``[B, T]`` (float64, 0 elsewhere) of each ``sampled`` row's target at the
    model's current parameters, as the sampler computes it: eval mode, no autocast, the
    float64 log-softmax of the fp32 logits, every RNG stream untouched (E1)."""
    inner = getattr(model, "module", model)  # one rank's own forward: no collective
    out = torch.zeros(batch.labels.shape, dtype=torch.float64)
    mask = sampled & (batch.labels != IGNORE_INDEX)
    if not bool(mask.any()):
        return out
    with isolated(inner):
        hidden = inner(batch_to_device(batch, device))  # [B, T, H]
        rows = hidden[mask.to(hidden.device)]  # [N, H]
        targets = batch.labels[mask].to(hidden.device)  # [N]
        parts = []
        for start in range(0, rows.shape[0], CHUNK_ROWS):
            logits = inner.logits(rows[None, start:start + CHUNK_ROWS])[0].float()  # [n, V]
            logp = torch.log_softmax(logits.double(), dim=-1)
            parts.append(logp.gather(1, targets[start:start + CHUNK_ROWS, None])[:, 0])
    out[mask] = torch.cat(parts).cpu()
    return out


class ClippedRollouts(PolicyRollouts):
    """``PolicyRollouts`` whose window is trained by ``policy.epochs`` optimizer steps on
    the clipped surrogate (the engine's ``next_pass``), ``log pi_old`` recorded."""

    def trajectory_batch(self, trajectories: list, microbatch: int) -> Batch:
        """The rollouts' batch, each sampled row's ``log pi_old`` (the sampler's) in
        ``meta["policy"].old_logprob``."""
        batch = super().trajectory_batch(trajectories, microbatch)
        rows: PolicyRows = batch.meta["policy"]
        old = torch.zeros(rows.coefficient.shape, dtype=torch.float64)
        for b, (r, _, c, _) in enumerate(trajectories):
            start = len(r.prompt) - 1 + len(r.forced)
            old[b, start:start + len(c.tokens)] = torch.tensor(c.logprobs, dtype=torch.float64)
        return replace(batch, meta={**batch.meta, "policy": replace(rows, old_logprob=old)})

    def record(self, window: int, r: Any, k: int, c: Any, *rest: Any, **named: Any) -> dict:
        """The journal's sample record with each sampled token's ``log pi_old``."""
        return {**super().record(window, r, k, c, *rest, **named),
                "old_logprobs": list(c.logprobs)}

    def next_pass(self, model: torch.nn.Module, batches: Sequence[Batch], *, step: int,
                  device: torch.device, reducer: Any = None
                  ) -> tuple[list[Batch], dict] | None:
        """The batches of the window's step ``step + 1`` (0-based ``step``) at the
        parameters the last step made, with their clipped coefficients; None after
        ``policy.epochs`` steps. The ledger's record counts the sampled tokens, the
        clipped ones and sums ``rho`` over every rank."""
        if step >= self.policy.epochs:
            return None
        out, totals = [], torch.zeros(3, dtype=torch.float64)
        for batch in batches:
            rows: PolicyRows | None = batch.meta.get("policy")
            if rows is None or rows.old_logprob is None or batch.labels.numel() == 0:
                out.append(batch)
                continue
            sampled = rows.sampled & (batch.labels != IGNORE_INDEX)
            logp = sampled_logprobs(model, batch, sampled, device)
            coefficient, rho, clipped = clipped_coefficients(
                rows.coefficient, logp, rows.old_logprob, sampled,
                low=self.policy.clip_ratio, high=self.policy.clip_high)
            totals += torch.tensor([float(sampled.sum()), float(clipped.sum()),
                                    float(rho[sampled].sum())], dtype=torch.float64)
            out.append(replace(batch, meta={**batch.meta,
                                            "policy": replace(rows, coefficient=coefficient)}))
        if reducer is not None and getattr(reducer, "world_size", 1) > 1:
            totals = reducer.sum(totals)
        n, clipped_n, rho_sum = totals.tolist()
        return out, {"epoch": step, "sampled_tokens": int(n), "clipped_tokens": int(clipped_n),
                     "ratio_mean": rho_sum / n if n else None}
