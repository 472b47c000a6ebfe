"""Conformance probes for sequence-level policy loops (Q3, Q4).

A policy loop (REINFORCE with a group baseline: RLOO, GRPO, DAPO) is driven through a
``PolicyStep``. The probe fixes the window: the prompts, the K completions of each and
each completion's reward, so sampling is out of the picture. The loop is asked for the
gradient of its first update under a given micro-batch size (``gradient``). The probe
computes each completion's score-function gradient g_i = grad sum_t log pi(y_i,t | x_i,
y_i,<t) itself, in float64 on the loop's own weights, and recovers the coefficient the
loop put on each completion by least squares: the loop's loss gradient is
-sum_i c_i g_i. The contract's coefficients are c_i = A_i / D: A_i the leave-one-out
advantage (the baseline is the mean of the other K-1 rewards, Q3), D the window's
sampled-token count, over every micro-batch and rank (Q4).

Probes: ``policy_split`` (Q4: c_i * D is the sequence's advantage, the same when the
window's lengths are swapped; the same window as 1, 2 and 4 micro-batches),
``policy_ranks`` (Q4: the same window over two ranks, where the target can run them)
and ``policy_baseline`` (Q3: the exact expected update for binary rewards).
Design and derivations: docs/design/audit.md#auditpolicy_probespy (Q3, Q4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from exactstep.audit.probes import RTOL, Measure, NotApplicable, Probe, TargetFault
from exactstep.audit.protocol import ProbeSpec

SPEC = ProbeSpec()
K = 4  # samples per prompt in every probe window
FIT_RESIDUAL = 1e-3  # the loop's gradient must lie in the completions' span to this


@dataclass(frozen=True)
class PolicyWindow:
    """One window of fixed rollouts: ``prompts[p]`` (token ids, ``BOS`` first, all of
    one length), ``completions[p][k]`` (content ids) and ``rewards[p][k]``."""

    prompts: tuple[tuple[int, ...], ...]
    completions: tuple[tuple[tuple[int, ...], ...], ...]
    rewards: tuple[tuple[float, ...], ...]

    @property
    def samples(self) -> int:
        return sum(len(group) for group in self.completions)

    @property
    def tokens(self) -> int:
        return sum(len(c) for group in self.completions for c in group)

    def flat(self) -> list[tuple[tuple[int, ...], tuple[int, ...], float]]:
        """(prompt, completion, reward) in group order."""
        return [(p, c, r) for p, cs, rs in zip(self.prompts, self.completions, self.rewards,
                                               strict=True)
                for c, r in zip(cs, rs, strict=True)]


@runtime_checkable
class PolicyStep(Protocol):
    """A policy-training loop as the probes drive it.

    ``build(spec)`` makes the model afresh from ``spec`` (same seed, same weights);
    ``module`` is it. ``logits(tokens)`` gives ``[B, L, V]`` for unpadded rows.
    ``gradient(window, micro_batch)`` runs the loop's own code over ``window`` (its
    completions and rewards as given, ``micro_batch`` sequences per forward, so
    ``window.samples // micro_batch`` accumulation steps) up to its first optimizer
    step and returns the gradient that step would apply, by parameter name, before
    clipping. ``ranks`` (optional attribute, default 1): the most ranks
    ``gradient(window, micro_batch, ranks=R)`` can spread the window over."""

    module: torch.nn.Module

    def build(self, spec: ProbeSpec) -> None: ...

    def logits(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def gradient(self, window: PolicyWindow, micro_batch: int,
                 ranks: int = 1) -> dict[str, torch.Tensor]: ...


# -- the contract ---------------------------------------------------------------------

def leave_one_out(rewards: Sequence[float]) -> list[float]:
    """A_i = r_i - mean of the other rewards of the group (Q3)."""
    total, k = sum(rewards), len(rewards)
    return [r - (total - r) / (k - 1) for r in rewards]


def contract_coefficients(window: PolicyWindow) -> list[float]:
    """c_i = A_i / D: leave-one-out advantages over the window's token count (Q3, Q4)."""
    return [a / window.tokens for group in window.rewards for a in leave_one_out(group)]


def expected_scale(f_rewarded: Sequence[float], f_unrewarded: Sequence[float],
                   p: float) -> float:
    """kappa(p) for binary rewards (docs/design/audit.md#auditpolicy_probespy).

    ``f_rewarded[m]`` / ``f_unrewarded[m]``: the advantage a loop gives a sample with
    reward 1 / 0 when m of the other K-1 samples of its group have reward 1. For a
    prompt whose completions succeed with probability p, the loop's expected update is
    kappa(p) * (K / D) * grad J (J the success probability), with kappa(p) =
    sum_m Binomial(m; K-1, p) (f_rewarded[m] - f_unrewarded[m]); an unbiased
    estimator of the declared objective has kappa = 1 for every p."""
    n = len(f_rewarded) - 1
    return sum(math.comb(n, m) * p ** m * (1 - p) ** (n - m)
               * (f_rewarded[m] - f_unrewarded[m]) for m in range(n + 1))


# -- observation ----------------------------------------------------------------------

def sequence_gradients(step: PolicyStep, window: PolicyWindow) -> torch.Tensor:
    """``[N, P]`` float64: row i is grad_theta sum_t log pi(y_i,t | x_i, y_i,<t) at the
    step's current weights (a float64 pass; the float32 weights are restored exactly)."""
    module = step.module
    params = [p for _, p in sorted(module.named_parameters()) if p.requires_grad]
    dtype = params[0].dtype
    rows = []
    module.double()
    try:
        was_training = module.training
        module.eval()
        for prompt, completion, _ in window.flat():
            tokens = torch.tensor([list(prompt) + list(completion)])
            logp = torch.log_softmax(step.logits(tokens)[0].double(), dim=-1)
            start = len(prompt) - 1
            targets = tokens[0, len(prompt):]
            total = logp[start:start + len(completion)].gather(1, targets[:, None]).sum()
            grads = torch.autograd.grad(total, params, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                                   for g, p in zip(grads, params, strict=True)]))
        module.train(was_training)
    finally:
        module.to(dtype)
    return torch.stack(rows)


def flat_gradient(step: PolicyStep, gradient: dict[str, torch.Tensor]) -> torch.Tensor:
    names = [n for n, p in sorted(step.module.named_parameters()) if p.requires_grad]
    missing = [n for n in names if n not in gradient]
    if missing:
        raise TargetFault(f"the loop returned no gradient for {missing[0]!r}")
    flat = torch.cat([gradient[n].detach().double().reshape(-1) for n in names])
    if not torch.isfinite(flat).all():
        raise TargetFault("the loop's gradient is non-finite")
    return flat


def coefficients(step: PolicyStep, window: PolicyWindow, micro_batch: int,
                 ranks: int = 1) -> list[float]:
    """The coefficient the loop put on each completion (group order): the least-squares
    c with loss gradient = -sum_i c_i g_i. A gradient outside the completions' span (a
    KL or entropy term, clipping) is a ``TargetFault`` naming its share."""
    step.build(SPEC)
    basis = sequence_gradients(step, window)
    if ranks > 1:
        by_rank = rank_gradients(step, window, micro_batch, ranks)
        for r, other in enumerate(by_rank[1:], start=1):
            if any(not torch.equal(other[n], by_rank[0][n]) for n in by_rank[0]):
                raise TargetFault(f"rank {r}'s gradient differs from rank 0's")
        grad = flat_gradient(step, by_rank[0])
    else:
        grad = flat_gradient(step, step.gradient(window, micro_batch))
    if float(grad.norm()) == 0.0:
        raise TargetFault("the loop's gradient is zero for a window with advantages")
    solution = torch.linalg.lstsq(basis.T, -grad[:, None]).solution[:, 0]
    residual = float((basis.T @ solution + grad).norm() / grad.norm())
    if residual > FIT_RESIDUAL:
        raise TargetFault(f"{residual:.1e} of the loop's gradient is not a combination of "
                          "the completions' log-probability gradients (a KL, entropy or "
                          "clipped term?); set those off for the audit")
    return [float(v) for v in solution]


def rank_gradients(step: PolicyStep, window: PolicyWindow, micro_batch: int,
                   world: int) -> list[dict[str, torch.Tensor]]:
    """``step.gradient`` in ``world`` forked processes of one gloo job (the step builds
    in each), by rank. The environment a launcher sets (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...) is there; the group is initialised for the step unless it says
    it does that itself (``PolicyStep.initializes_process_group``)."""
    from exactstep.audit.probes import run_job

    return run_job(rank_worker, world, (step, window, micro_batch))


def rank_worker(rank: int, world: int, port: int, step: PolicyStep, window: PolicyWindow,
                micro_batch: int, out: str) -> None:
    """One rank of ``rank_gradients``."""
    import os
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from exactstep.audit.probes import DDP_TIMEOUT_S

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if not getattr(step, "initializes_process_group", False):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=DDP_TIMEOUT_S))
    try:
        step.build(SPEC)
        grads = step.gradient(window, micro_batch, world)
        torch.save({n: g.detach().clone() for n, g in grads.items()},
                   Path(out) / f"{rank}.pt")
        dist.barrier()  # no rank tears the group down under a peer's pending gloo work
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def tolerance(step: PolicyStep, window: PolicyWindow) -> float:
    """The agreement asked of recovered coefficients, relative to the largest: the
    audit's fp32 ``RTOL`` times the basis's condition number (a relative error e in
    the loop's fp32 gradient moves the least-squares solution by at most cond * e)."""
    step.build(SPEC)
    singular = torch.linalg.svdvals(sequence_gradients(step, window))
    return RTOL * max(1.0, float(singular[0] / singular[-1]))


def relative(observed: Sequence[float], expected: Sequence[float]) -> float:
    scale = max(abs(v) for v in expected) or 1.0
    return max(abs(o - e) for o, e in zip(observed, expected, strict=True)) / scale


# -- probe windows --------------------------------------------------------------------

def prompt(group: int) -> tuple[int, ...]:
    """A three-token prompt, ``BOS`` and two content ids, different per group."""
    content = SPEC.vocab_size - 3
    return (SPEC.bos_id, 3 + group % content, 3 + (5 * group + 2) % content)


def completion(group: int, k: int, length: int) -> tuple[int, ...]:
    content = SPEC.vocab_size - 3
    return tuple(3 + (7 * group + 3 * k + 5 * t + k * t) % content for t in range(length))


SPLIT_LENGTHS = ((1, 5, 2, 6), (3, 1, 4, 2))
#: The same completions' lengths, permuted within each group: every sample's length
#: changes, the window's token count (23) and longest completion (6) do not.
SWAPPED_LENGTHS = ((6, 2, 5, 1), (2, 4, 1, 3))
SPLIT_REWARDS = ((1.0, 0.0, 0.5, 0.25), (0.0, 1.0, 0.75, 0.125))


def split_window(lengths: tuple[tuple[int, ...], ...] = SPLIT_LENGTHS) -> PolicyWindow:
    """Two prompts of four completions, 1-6 tokens long, rewards all distinct within a
    group: micro-batches of 2 or 4 hold unequal token counts however they are drawn.
    ``lengths=SWAPPED_LENGTHS``: its twin, the same rewards on other lengths."""
    return PolicyWindow(tuple(prompt(g) for g in range(2)),
                        tuple(tuple(completion(g, k, n) for k, n in enumerate(ls))
                              for g, ls in enumerate(lengths)), SPLIT_REWARDS)


def baseline_window() -> PolicyWindow:
    """Five prompts of K = 4 two-token completions; group n has n rewarded samples
    (n = 0..4), so every (own reward, rewarded others) pair occurs."""
    rewards = tuple(tuple(1.0 if k < n else 0.0 for k in range(K)) for n in range(K + 1))
    return PolicyWindow(tuple(prompt(g) for g in range(K + 1)),
                        tuple(tuple(completion(g, k, 2) for k in range(K))
                              for g in range(K + 1)), rewards)


# -- the probes -----------------------------------------------------------------------

SPLITS = (4, 2)  # micro-batch sizes compared with the whole window (8) in one


def length_weights(advantages: Sequence[float], twin: Sequence[float],
                   lengths: Sequence[int], twin_lengths: Sequence[int]
                   ) -> tuple[float, float, int, int]:
    """How a sample's token weight moves with its length: ``(exponent, ratio, short,
    long)``.

    ``advantages[i]`` and ``twin[i]`` are ``c_i * D`` for the same sample (same group,
    same reward) at ``lengths[i]`` and ``twin_lengths[i]``. Each pair gives
    ``log(twin / a) / log(twin_length / length)``; the exponent is their mean (0 for
    one objective S / D, -1 for a per-sequence token mean). ``ratio``: the weight of
    a ``short``-token completion's token over a ``long``-token one's, for the sample
    whose length changes the most (1 against 6 tokens in the probe's windows)."""
    exponents, widest = [], (1.0, 1, 1)
    for a, b, n, m in zip(advantages, twin, lengths, twin_lengths, strict=True):
        if n == m or a * b <= 0.0:
            continue
        exponents.append(math.log(b / a) / math.log(m / n))
        if max(n, m) / min(n, m) > widest[2] / widest[1]:
            widest = ((a / b) if n < m else (b / a), min(n, m), max(n, m))
    if not exponents:
        return 0.0, 1.0, 1, 1
    return (round(math.fsum(exponents) / len(exponents), 3) + 0.0,) + widest


def policy_split(step: PolicyStep) -> Measure:
    """Q4's contract itself, and its invariance under accumulation.

    The contract: each scored token's coefficient times the window's scored-token
    count D is its sequence's advantage, a function of the rewards alone; a token's
    weight never depends on its sequence's length. The probe reads ``a_i = c_i * D``
    for the window and for its twin (``SWAPPED_LENGTHS``: the same rewards on other
    lengths, the same D and longest completion) and asks for the same ``a`` in both:
    a per-sequence token mean (``a_i`` proportional to ``1 / length``) fails it, and
    the observed line gives the exponent of the length and the short-to-long weight
    ratio. Then the same eight completions as 1 x 8, 2 x 4 and 4 x 2 micro-batches: one
    objective, so the same coefficients. A per-micro-batch normaliser makes them
    depend on which completions share a micro-batch; dividing the window again by the
    accumulation steps scales them by 1 / steps. The baseline's own scale is
    ``policy_baseline``'s business, not this probe's. Values: ``c x D`` of each split
    that ran (2x4, then 4x2), then the twin's, against the whole window's."""
    window, twin = split_window(), split_window(SWAPPED_LENGTHS)
    whole = coefficients(step, window, window.samples)
    twin_whole = coefficients(step, twin, twin.samples)
    tol = max(tolerance(step, window), tolerance(step, twin))
    adv = [c * window.tokens for c in whole]
    twin_adv = [c * twin.tokens for c in twin_whole]
    lengths = [n for group in SPLIT_LENGTHS for n in group]
    twin_lengths = [n for group in SWAPPED_LENGTHS for n in group]
    length_err = relative(twin_adv, adv)
    exponent, ratio, short, long_ = length_weights(adv, twin_adv, lengths, twin_lengths)
    length_ok = length_err <= tol
    notes = [f"c x D, same rewards on swapped lengths: deviation {length_err:.2e}, token "
             f"weight ~ length^{exponent:+.2f} (a {short}-token completion's token "
             f"{ratio:.2f}x a {long_}-token one's)"]
    worst, observed_values = 0.0, []
    ran = 0
    for size in SPLITS:
        try:
            got = coefficients(step, window, size)
        except NotApplicable as exc:
            notes.append(f"{window.samples // size}x{size}: not run ({exc})")
            continue
        err = relative(got, whole)
        worst = max(worst, err)
        scale = sum(g * w for g, w in zip(got, whole, strict=True)) / sum(w * w for w in whole)
        notes.append(f"{window.samples // size}x{size}: deviation {err:.2e}, scale {scale:.3f}")
        observed_values += [g * window.tokens for g in got]
        ran += 1
    if ran == 0 and length_ok:
        raise NotApplicable("; ".join(notes))
    fix = None
    if not length_ok:
        fix = (f"a token's weight goes as its sequence's length^{exponent:+.2f} (a "
               f"{short}-token completion's token counts {ratio:.1f}x a {long_}-token "
               "one's): "
               "the loss normalises each sequence by its own length (a per-sequence "
               "token mean, then a mean over sequences); give every scored token its "
               "sequence's advantage and divide the window's sum once, by its token "
               "count over every micro-batch and rank, or by a constant")
    return Measure(length_ok and worst <= tol,
                   f"c x D = the sequence's advantage (the same on swapped lengths) and "
                   f"the coefficients of 1x8 for 2x4 and 4x2, within {tol:.1e}",
                   "; ".join(notes), adv * (ran + 1), observed_values + twin_adv, fix)


def policy_ranks(step: PolicyStep) -> Measure:
    """The same window on two ranks of four completions each against one process:
    the normaliser is reduced over the ranks (Q4)."""
    if getattr(step, "ranks", 1) < 2:
        raise NotApplicable("the target does not run ranks (PolicyStep.ranks < 2)")
    window = split_window()
    whole = coefficients(step, window, window.samples)
    got = coefficients(step, window, window.samples // 2, ranks=2)
    tol = tolerance(step, window)
    err = relative(got, whole)
    scale = sum(g * w for g, w in zip(got, whole, strict=True)) / sum(w * w for w in whole)
    return Measure(err <= tol, f"coefficients of one process within {tol:.1e}",
                   f"2 ranks x 4: deviation {err:.2e}, scale {scale:.3f}", whole, got)


def policy_baseline(step: PolicyStep) -> Measure:
    """Binary rewards, K = 4, equal lengths, one micro-batch (every normaliser then
    agrees on D = the window's tokens): the advantages the loop gave, a_i = c_i * D,
    tabled by (own reward, rewarded others), and the expected update's scale kappa(p)
    on grad J for success rates p (``expected_scale``). Unbiased for the declared
    objective: kappa = 1 at every p; a baseline holding the sample's own reward gives
    (K-1)/K, a division by the group's spread makes kappa depend on p (Q3)."""
    window = baseline_window()
    got = [c * window.tokens for c in coefficients(step, window, window.samples)]
    tol = tolerance(step, window)
    by_group = [got[g * K:(g + 1) * K] for g in range(K + 1)]
    rewarded, unrewarded = [0.0] * K, [0.0] * K
    for n, group in enumerate(by_group):
        for k, a in enumerate(group):
            first = group[0] if k < n else group[-1]
            if abs(a - first) > tol * max(1.0, abs(first)):
                raise TargetFault(f"two samples of one group with the same reward got "
                                  f"advantages {first:.4f} and {a:.4f}")
            if k < n:
                rewarded[n - 1] = a  # m = n - 1 rewarded others
            else:
                unrewarded[n] = a
    rates = (0.1, 0.25, 0.5, 0.75, 0.9)
    kappas = [expected_scale(rewarded, unrewarded, p) for p in rates]
    contract = contract_coefficients(window)
    err = max(abs(k - 1.0) for k in kappas)
    table = ", ".join(f"m={m}: {rewarded[m]:+.3f}/{unrewarded[m]:+.3f}" for m in range(K))
    observed = (f"kappa(p) at p={'/'.join(f'{p:g}' for p in rates)}: "
                f"{'/'.join(f'{k:.3f}' for k in kappas)}; advantages (rewarded/unrewarded, "
                f"m rewarded others) {table}")
    return Measure(err <= tol, f"kappa(p) = 1 within {tol:.1e} (leave-one-out: "
                   "rewarded 1-m/3, unrewarded -m/3)", observed,
                   [c * window.tokens for c in contract], got)


POLICY_PROBES = (
    Probe("policy_split", "Q4", "normalise once per window: give each scored token its "
          "sequence's advantage and divide the summed per-token terms by the window's "
          "token count over every micro-batch and rank (gathered before the first "
          "backward) or by a constant; not per micro-batch, not per sequence, and not "
          "again by the accumulation steps", policy_split),
    Probe("policy_ranks", "Q4", "reduce the normaliser over the ranks (all-reduce the "
          "window's token count) before dividing; DDP then averages gradients, so scale "
          "each rank's sum by the world size over the global count", policy_ranks),
    Probe("policy_baseline", "Q3", "use a baseline that excludes the scored sample: the "
          "mean of the other K-1 rewards of its group (leave-one-out), and do not divide "
          "by the group's spread (it holds the sample's own reward); a differently scaled "
          "estimator must be declared as such", policy_baseline),
)
