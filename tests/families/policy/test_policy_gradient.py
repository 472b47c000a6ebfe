"""Q3, Q4: the policy window's gradient is REINFORCE's, in expectation, exactly.

A tabular policy small enough to enumerate: three tokens, a one-token prompt, two
drawn tokens (no stop token), so nine sequences. Its exact expected gradient,
``-grad E[R]``, comes from enumerating every sequence in float64 (autograd of
``sum_y pi(y) R(y)``). The engine's window (real rollouts, addressed draws, the policy
plan, ``UpdateEngine``) estimates it with ``K`` samples of each of ``P`` prompts
and ``D = P K`` (``normalizer = "constant"``), so its expectation is ``-grad E[R]``
for every baseline that does not depend on the scored sample. Over ``W`` windows (each
a fresh draw: its own window index) the mean gradient must be within five standard
errors of the exact one (the standard error from the windows' own spread; the
estimator's mean is normal to a good approximation over a few hundred windows), for
``none``, ``moving_average``, ``leave_one_out`` and ``learned`` (MIXER's regressor on
the state before each token, learning as the windows go).

Negative control: GRPO's group mean including the scored sample, whose expectation is
``(K - 1) / K`` of it: with ``K = 2``, half. The same check fails, and the mean sits
within the same bound of half the exact gradient. And a learned baseline fed the state
after the token it scores (it has seen the action) is outside the bound.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch import nn

from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.regressor import Regressor
from exactstep.families.policy.rewards import Reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.policy import policy_plan
from exactstep.rows.batch import Batch, Segment
from exactstep.rows.example import Example
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

V, K, P, W = 3, 2, 32, 240
pytestmark = pytest.mark.slow  # 4 x 240 windows of 32 prompts
TARGET = (1, 2)  # the rewarded sequence


class TabularPolicy(nn.Module):
    """``logits(token at t) = E[token] + Pos[t]``: hidden states are the logits
    (``head_weight`` is the identity, not trained); ``positions`` rows of ``Pos``."""

    def __init__(self, seed: int = 5, positions: int = 4, scale: float = 0.5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(scale * torch.randn(V, V, generator=g))
        self.pos = nn.Parameter(scale * torch.randn(positions, V, generator=g))
        self.register_buffer("eye", torch.eye(V))

    @property
    def head_weight(self) -> torch.Tensor:
        return self.eye

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.embed[batch.input_ids] + self.pos[batch.position_ids]  # [B, T, V]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.eye.t()


def reward(y: tuple[int, ...]) -> float:
    return 1.0 if tuple(y) == TARGET else 0.25 * (y[0] == TARGET[0])


def exact_gradient(model: TabularPolicy) -> dict[str, np.ndarray]:
    """``-grad sum_y pi(y) R(y)`` over all nine sequences, float64."""
    embed = model.embed.detach().double().requires_grad_(True)
    pos = model.pos.detach().double().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for y in itertools.product(range(V), repeat=2):
        first = torch.log_softmax(embed[0] + pos[0], -1)[y[0]]
        second = torch.log_softmax(embed[y[0]] + pos[1], -1)[y[1]]
        total = total + torch.exp(first + second) * reward(y)
    (-total).backward()
    return {"embed": embed.grad.numpy(), "pos": pos.grad.numpy()}


class Leaky(Regressor):
    """WRONG (Q3): the learned baseline fed the state *after* each sampled token, which
    has seen the action it scores."""

    def states(self, model, context, continuations, device, **kw):
        longer = super().states(model, context, [[*c, 0] for c in continuations], device, **kw)
        return [s[1:] for s in longer]


def learned(regressor: Regressor) -> Regressor:
    """A regressor starting from fixed weights (1, -1, 0.5) and bias 0.3 (far from the
    rewards it learns, so a baseline that sees the action is far from harmless)."""
    w = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    c = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    regressor.load_state_dict({"weight": w.detach(), "bias": c.detach(), "optimizer":
                               torch.optim.Adam([w, c], lr=regressor.lr).state_dict()})
    return regressor


def estimated_gradients(baseline: str) -> tuple[TabularPolicy, list[dict[str, np.ndarray]]]:
    """The engine's gradient in each of ``W`` windows of ``P`` prompts (weights
    unchanged between windows: the captured gradient is read before a step of 0).
    ``learned_leaky``: the learned baseline with ``Leaky`` states."""
    model = TabularPolicy()
    examples = [Example(example_id=i, tokens=np.array([0, *TARGET], dtype=np.int64))
                for i in range(P)]
    scored = Reward("tabular", lambda s: reward(tuple(s.response)),
                    {"name": "tabular", "kind": "test"}, False)
    leaky = baseline == "learned_leaky"
    baseline = "learned" if leaky else baseline
    program = PolicyRollouts(PolicyConfig(over="causal", baseline=baseline,
                                          normalizer="constant", constant=float(P * K)),
                             GenerationConfig(samples=K, max_new_tokens=2), seed=11,
                             seq_len=8, examples=examples, reward=scored, stop_ids=(),
                             decode=lambda ids: " ".join(map(str, ids)))
    if baseline == "learned":
        program.regressor = learned(Leaky(1e-2) if leaky else Regressor(1e-2))
    cfg = UpdateConfig(lr=1e-30, schedule="constant", warmup=0, clip=0.0, weight_decay=0.0,
                       optimizer="sgd", momentum=0.0)
    optimizer, _ = build_optimizer(model, cfg)
    grads: list[dict[str, np.ndarray]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
        {"embed": model.embed.grad.double().numpy().copy(),
         "pos": model.pos.grad.double().numpy().copy()}))
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, W),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=0), device="cpu", pad_id=0,
                          plan=policy_plan("constant", float(P * K)), program=program)
    prompts = one_token_prompts(P)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for window in range(W):
        if engine.run_window([prompts], window).outcome is Outcome.NO_OBJECTIVE:
            # every advantage zero: the estimate of this window is a zero gradient
            grads.append({n: np.zeros(p.shape) for n, p in model.named_parameters()})
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # lr ~ 0
    return model, grads


def far_from(grads: list[dict[str, np.ndarray]], expected: dict[str, np.ndarray]
             ) -> list[str]:
    """Components whose mean over windows is more than five standard errors from
    ``expected`` (and from it by more than fp32's rounding of the sums, 1e-6)."""
    out = []
    for name, want in expected.items():
        samples = np.stack([g[name] for g in grads])  # [W, ...]
        mean = samples.mean(0)
        se = samples.std(0, ddof=1) / np.sqrt(len(grads))
        bad = np.abs(mean - want) > 5 * se + 1e-6
        out += [f"{name}{tuple(i)}: {mean[tuple(i)]:.4f} vs {want[tuple(i)]:.4f} "
                f"(se {se[tuple(i)]:.4f})" for i in np.argwhere(bad)]
    return out


@pytest.mark.parametrize("baseline", ["none", "moving_average", "leave_one_out", "learned"])
def test_the_windows_mean_gradient_is_the_exact_expected_gradient(baseline):
    model, grads = estimated_gradients(baseline)
    exact = exact_gradient(model)
    assert len(grads) == W
    assert max(np.abs(v).max() for v in exact.values()) > 0.05  # a gradient to find
    assert far_from(grads, exact) == []


def test_negative_control_the_group_mean_with_the_sample_is_biased_by_k_minus_1_over_k():
    model, grads = estimated_gradients("group_mean_with_self")
    exact = exact_gradient(model)
    assert far_from(grads, exact) != []
    assert far_from(grads, {n: (K - 1) / K * g for n, g in exact.items()}) == []


def test_negative_control_a_learned_baseline_that_sees_the_action_is_biased():
    model, grads = estimated_gradients("learned_leaky")
    assert far_from(grads, exact_gradient(model)) != []


def one_token_prompts(n: int) -> Batch:
    """A micro-batch of examples ``0..n-1``, each the one-token prompt ``(0,)`` in a row
    of its own (the tabular policies' window)."""
    return Batch(input_ids=torch.zeros((n, 1), dtype=torch.int64),
                 labels=torch.full((n, 1), -100, dtype=torch.int64),
                 position_ids=torch.zeros((n, 1), dtype=torch.int64),
                 segment_ids=torch.ones((n, 1), dtype=torch.int32),
                 segments=tuple((Segment(i, 0, 0, 0, 1),) for i in range(n)))

