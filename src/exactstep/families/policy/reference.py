"""A pure-Python reference of one policy window's objective (L6, Q3, Q4).

Written from the definitions with ``math`` alone: advantages per baseline, each scored
token's coefficient, the normalizer ``D`` and the objective ``S / D`` for given token
losses; the KL terms against a frozen reference (``k1`` in the reward, ``k3`` a loss
term per sampled token, ``k3_corrected`` its ratio-corrected form), MIXER's
curriculum (``delta`` on the committed-window clock, U5), and the clipped surrogate's
gradient with a tabular policy's plain-SGD steps over one rollout batch
(``policy.epochs``). The engine's rollouts, plan and clipped steps
(``families.policy.rollouts``, ``objective.policy``, ``families.policy.clipped``) must
agree with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One trajectory of a prompt's group: its reward, how many reference tokens were
    teacher-forced before it, and how many tokens were sampled; with ``kl``, each
    sampled token's ``log pi`` and ``log pi_ref``."""

    reward: float
    forced: int
    sampled: int
    baselines: tuple[float, ...] = ()  # the learned baseline's b_t per sampled token
    logprobs: tuple[float, ...] = ()  # log pi of each sampled token (kl)
    ref_logprobs: tuple[float, ...] = ()  # log pi_ref of each sampled token (kl)


def advantages(rewards: Sequence[float], baseline: str, state: float | None = None,
               std_eps: float = 1e-6) -> list[float]:
    """The advantages of one prompt's group of rewards."""
    k = len(rewards)
    mean = math.fsum(rewards) / k
    if baseline in ("none", "learned"):  # learned: b_t per token, in the coefficients
        return [float(r) for r in rewards]
    if baseline == "moving_average":
        b = 0.0 if state is None else state
        return [r - b for r in rewards]
    if baseline == "leave_one_out":
        total = math.fsum(rewards)
        return [r - (total - r) / (k - 1) for r in rewards]
    if baseline == "group_mean_with_self":
        return [r - mean for r in rewards]
    if baseline == "group_normalized":
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / k)
        return [(r - mean) / (std + std_eps) for r in rewards]
    raise ValueError(f"unknown baseline {baseline!r}")


def k1_penalty(logprobs: Sequence[float], ref_logprobs: Sequence[float],
               beta: float) -> float:
    """k1: ``beta * sum_t (log pi - log pi_ref)`` over a trajectory's sampled tokens,
    subtracted from its reward before the baseline."""
    return beta * math.fsum(lp - lr for lp, lr in zip(logprobs, ref_logprobs, strict=True))


def k3_term(logprob: float, ref_logprob: float, beta: float) -> float:
    """k3's loss term of one sampled token: ``beta * (r - log r - 1)``, ``r = pi_ref /
    pi`` (non-negative, 0 where the policies agree)."""
    log_r = ref_logprob - logprob
    return beta * (math.exp(log_r) - log_r - 1.0)


def k3_coefficient(logprob: float, ref_logprob: float, beta: float) -> float:
    """k3's term as a coefficient on the token's loss ``-log pi``: its derivative in
    ``log pi`` is ``beta * (1 - r)`` (``dr / d log pi = -r``), and a coefficient ``c``
    on ``-log pi`` has derivative ``-c``, so ``c = beta * (r - 1)``."""
    return beta * (math.exp(ref_logprob - logprob) - 1.0)


def k3_corrected_coefficient(logprob: float, ref_logprob: float, beta: float) -> float:
    """``kl = "k3_corrected"``: the loss ``beta * k3 * pi / sg(pi)`` has derivative
    ``beta * k3 + beta * (1 - r)`` in ``log pi`` where the ratio is 1 (the ratio's
    derivative times k3, plus k3's own), so its coefficient on ``-log pi`` is minus
    that (``= -beta * (log pi - log pi_ref)``)."""
    r = math.exp(ref_logprob - logprob)
    return -(k3_term(logprob, ref_logprob, beta) + beta * (1.0 - r))


def mixer_delta(clock: int, *, start: int, step: int, every: int, most: int) -> int:
    """MIXER's sampled suffix length after ``clock`` committed windows (U5):
    ``min(most, start + step * floor(clock / every))``."""
    return min(most, start + step * (clock // every))


def mixer_forced(reference: Sequence[int], delta: int) -> tuple[int, ...]:
    """The reference tokens teacher-forced at ``delta``: all but the last ``delta`` (all
    of them when ``delta`` is 0); the rest of the response is sampled."""
    return tuple(reference[:max(0, len(reference) - delta)])


def window_coefficients(groups: Sequence[Sequence[Sample]], *, baseline: str,
                        normalizer: str, constant: float = 1.0,
                        state: float | None = None, std_eps: float = 1e-6,
                        kl: str = "none", beta: float = 0.0
                        ) -> tuple[list[list[float]], float]:
    """``(coefficients, D)``: for every trajectory (groups in order, samples in order)
    its scored tokens' coefficients ``a`` (teacher-forced tokens first, then sampled),
    and the window's normalizer ``D``. ``kl = "k1"``: each reward less ``k1_penalty``
    before the baseline; ``"k3"``: each sampled token's coefficient plus
    ``k3_coefficient``; ``"k3_corrected"``: plus ``k3_corrected_coefficient``."""
    out: list[list[float]] = []
    for group in groups:
        rewards = [s.reward - (k1_penalty(s.logprobs, s.ref_logprobs, beta)
                               if kl == "k1" else 0.0) for s in group]
        adv = advantages(rewards, baseline, state, std_eps)
        for s, a in zip(group, adv, strict=True):
            sampled = [a - b for b in s.baselines] if baseline == "learned" else [a] * s.sampled
            if kl in ("k3", "k3_corrected"):
                term = k3_coefficient if kl == "k3" else k3_corrected_coefficient
                sampled = [x + term(lp, lr, beta) for x, lp, lr in
                           zip(sampled, s.logprobs, s.ref_logprobs, strict=True)]
            c = [1.0] * s.forced + sampled
            n = s.forced + s.sampled
            if normalizer == "sequence_mean" and n:
                c = [x / n for x in c]
            out.append(c)
    if normalizer == "token_mean":
        d = float(sum(len(c) for c in out))
    elif normalizer == "sequence_mean":
        d = float(sum(1 for c in out if c))
    else:
        d = float(constant)
    return out, d


def objective(coefficients: Sequence[Sequence[float]], losses: Sequence[Sequence[float]],
              d: float) -> float:
    """``S / D``: each scored token's coefficient times its loss, summed, over ``D``."""
    return math.fsum(a * loss for cs, ls in zip(coefficients, losses, strict=True)
                     for a, loss in zip(cs, ls, strict=True)) / d


def regressor_step(states: Sequence[Sequence[Sequence[float]]], targets: Sequence[float],
                   weight: Sequence[float], bias: float
                   ) -> tuple[float, list[float], float]:
    """The learned baseline's ``(loss, d loss / d w, d loss / d c)`` for trajectories
    whose sampled states are ``states[i]`` (``[n_i][H]``) and reward ``targets[i]``:
    ``loss = sum_{i,t} (w . h_it + c - R_i)^2 / N``."""
    errors = [(h, math.fsum(w * x for w, x in zip(weight, h, strict=True)) + bias - r)
              for hs, r in zip(states, targets, strict=True) for h in hs]
    n = len(errors)
    loss = math.fsum(e * e for _, e in errors) / n
    grad_w = [2.0 * math.fsum(h[j] * e for h, e in errors) / n for j in range(len(weight))]
    grad_b = 2.0 * math.fsum(e for _, e in errors) / n
    return loss, grad_w, grad_b


def surrogate_gradient(advantage: float, logprob: float, old_logprob: float, low: float,
                       high: float) -> float:
    """``d / d log pi`` of the clipped surrogate ``-min(rho A, clip(rho, 1 - low, 1 +
    high) A)``, ``rho = exp(log pi - log pi_old)``: ``-A rho`` when the min is the
    unclipped branch (ties too), 0 when it is the clipped one (constant in ``rho``)."""
    rho = math.exp(logprob - old_logprob)
    clipped = min(max(rho, 1.0 - low), 1.0 + high)
    if rho * advantage <= clipped * advantage:
        return -advantage * rho
    return 0.0


@dataclass(frozen=True)
class Trajectory:
    """One sampled trajectory for ``tabular_clipped_sgd``: its tokens (prompt, then the
    sampled ones), the prompt's length, and each sampled token's coefficient ``A``."""

    tokens: tuple[int, ...]
    prompt: int
    advantages: tuple[float, ...]


def _tabular_logprob(embed: list[list[float]], pos: list[list[float]], x: int, t: int,
                     y: int) -> tuple[float, list[float]]:
    """``(log pi(y), pi)`` of a tabular policy whose logits at column ``t`` after token
    ``x`` are ``embed[x] + pos[t]``."""
    z = [e + p for e, p in zip(embed[x], pos[t], strict=True)]
    top = max(z)
    log_total = top + math.log(math.fsum(math.exp(v - top) for v in z))
    return z[y] - log_total, [math.exp(v - log_total) for v in z]


@dataclass(frozen=True)
class ClippedSteps:
    """``tabular_clipped_sgd``'s result: the final tables, each step's clipped-token
    count and gradient mass ``sum_r |c_r| / d``, and the smallest distance of a later
    step's ``rho`` from a clip edge (how far rounding is from flipping a decision)."""

    embed: list[list[float]]
    pos: list[list[float]]
    clipped: list[int]
    masses: list[float]
    margin: float


def tabular_clipped_sgd(embed: list[list[float]], pos: list[list[float]],
                        trajectories: Sequence[Trajectory], *, epochs: int, lr: float,
                        d: float, low: float, high: float) -> ClippedSteps:
    """``epochs`` plain-SGD steps (step ``lr``) of a tabular policy on one rollout batch's
    clipped surrogate ``sum_r -min(rho A, clip(rho) A) / d``: ``log pi_old`` at the
    starting parameters, the first step on-policy (``rho = 1``)."""
    embed = [list(map(float, row)) for row in embed]
    pos = [list(map(float, row)) for row in pos]
    tokens = [(tr.tokens[tr.prompt - 1 + j], tr.prompt - 1 + j, tr.tokens[tr.prompt + j], a)
              for tr in trajectories for j, a in enumerate(tr.advantages)]
    old = [_tabular_logprob(embed, pos, x, t, y)[0] for x, t, y, _ in tokens]
    clipped_counts, masses, margin = [], [], math.inf
    for epoch in range(epochs):
        g_embed = [[0.0] * len(row) for row in embed]
        g_pos = [[0.0] * len(row) for row in pos]
        clipped, mass = 0, 0.0
        for (x, t, y, a), lp_old in zip(tokens, old, strict=True):
            logprob, probs = _tabular_logprob(embed, pos, x, t, y)
            if epoch == 0:
                logprob = lp_old  # on-policy: the ratio is 1
            else:
                rho = math.exp(logprob - lp_old)
                margin = min(margin, abs(rho - (1.0 + high)), abs(rho - (1.0 - low)))
            c = -surrogate_gradient(a, logprob, lp_old, low, high)  # on -log pi
            clipped += a != 0.0 and c == 0.0
            mass += abs(c) / d
            for v, p in enumerate(probs):  # d(-log pi(y)) / dz_v = p_v - [v == y]
                g = c * (p - (v == y)) / d
                g_embed[x][v] += g
                g_pos[t][v] += g
        embed = [[w - lr * g for w, g in zip(row, gs, strict=True)]
                 for row, gs in zip(embed, g_embed, strict=True)]
        pos = [[w - lr * g for w, g in zip(row, gs, strict=True)]
               for row, gs in zip(pos, g_pos, strict=True)]
        clipped_counts.append(int(clipped))
        masses.append(mass)
    return ClippedSteps(embed, pos, clipped_counts, masses, margin)
