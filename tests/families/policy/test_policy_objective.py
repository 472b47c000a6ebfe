"""Q3, Q4, L4: the policy window's advantages, coefficients and D against the pure-Python
reference (``families.policy.reference``), for every baseline and normalizer.

Property tests draw groups of rewards and trajectory lengths (teacher-forced and
sampled tokens), build the trajectory batches as the rollouts do
(``PolicyRollouts.trajectory_batch``, split over micro-batches as drawn) and plan them
(``objective.policy.policy_plan``). Independent expectation: the reference, written
from the definitions. Tolerance: each coefficient is the fp32 rounding of a float64
value (``|a32 - a| <= 2**-24 |a|``, plus the division's rounding for
``sequence_mean``); D is a count and exact.

Negative controls: a plan that normalised per micro-batch (the bug of public
trainers) or counted the group mean with the sample disagrees with the reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.families.policy import reference
from exactstep.families.policy.rollouts import PolicyRollouts, advantages
from exactstep.generation.prompts import Request
from exactstep.generation.sampler import Continuation
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.policy import policy_plan
from exactstep.objective.types import NoObjective, NoObjectiveCause

BASELINES = ["none", "moving_average", "leave_one_out", "group_mean_with_self",
             "group_normalized"]
NORMALIZERS = ["token_mean", "sequence_mean", "constant"]
UNIT = 2.0 ** -24

groups_strategy = st.lists(  # prompts, each a group of K samples (K shared)
    st.integers(min_value=2, max_value=4).flatmap(lambda k: st.lists(
        st.tuples(st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0]),
                  st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=5)),
        min_size=k, max_size=k)), min_size=1, max_size=5)


def trajectories(groups, baseline, state):
    """The rollouts' trajectory tuples (request, sample, continuation, coefficients)."""
    out = []
    for p, group in enumerate(groups):
        rewards = np.array([[r for r, _, _ in group]])
        _, adv = advantages(rewards, baseline, state, 1e-6)
        for k, (_, forced, sampled) in enumerate(group):
            request = Request(example_id=p, prompt=(1, 2), reference=tuple(range(3, 3 + forced)),
                              forced=tuple(range(3, 3 + forced)))
            cont = Continuation(tuple(range(10, 10 + sampled)), (0.0,) * sampled, False)
            out.append((request, k, cont, [1.0] * forced + [float(adv[0, k])] * sampled))
    return out


def plan_of(groups, baseline, normalizer, split, state=None):
    rollouts = PolicyRollouts.__new__(PolicyRollouts)  # only trajectory_batch is used
    trajs = trajectories(groups, baseline, state)
    cut = max(1, min(split, len(trajs)))
    parts = [trajs[i:i + cut] for i in range(0, len(trajs), cut)]
    batches = [rollouts.trajectory_batch(part, m) for m, part in enumerate(parts)]
    plan = policy_plan(normalizer, 3.0)(batches, ObjectiveConfig(), allow_empty=True)
    coeffs = []
    for b, c in zip(batches, plan.coefficients, strict=True):
        for row in range(b.labels.shape[0]):
            coeffs.append([float(x) for x, m in zip(c[row], b.labels[row] != -100, strict=True)
                           if m])
    return plan, coeffs


@settings(max_examples=150, deadline=None)
@given(groups=groups_strategy, baseline=st.sampled_from(BASELINES),
       normalizer=st.sampled_from(NORMALIZERS), split=st.integers(min_value=1, max_value=8),
       state=st.sampled_from([None, 0.25, -1.5]))
def test_coefficients_and_d_are_the_references(groups, baseline, normalizer, split, state):
    samples = [[reference.Sample(r, f, s) for r, f, s in g] for g in groups]
    want, d = reference.window_coefficients(samples, baseline=baseline, normalizer=normalizer,
                                            constant=3.0, state=state)
    plan, got = plan_of(groups, baseline, normalizer, split, state)
    assert plan.denominator == d
    assert plan.tokens == sum(len(c) for c in want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == len(w)
        for x, y in zip(g, w, strict=True):
            assert abs(x - y) <= 4 * UNIT * abs(y), (x, y)
    assert math.isclose(plan.signal, math.fsum(abs(x) for c in got for x in c),
                        rel_tol=1e-12, abs_tol=0.0)


def test_the_objective_value_is_the_references():
    """S / D from the plan's coefficients and given token losses, as the engine forms it,
    equals the reference's objective (fp32 coefficients: relative 2**-24 each)."""
    groups = [[(1.0, 1, 3), (0.0, 1, 2)], [(2.0, 0, 4), (0.5, 0, 1)]]
    for normalizer in NORMALIZERS:
        samples = [[reference.Sample(*s) for s in g] for g in groups]
        want_c, d = reference.window_coefficients(samples, baseline="leave_one_out",
                                                  normalizer=normalizer, constant=3.0)
        plan, got_c = plan_of(groups, "leave_one_out", normalizer, split=3)
        losses = [[0.1 * (i + 1) + 0.01 * j for j in range(len(c))] for i, c in enumerate(want_c)]
        want = reference.objective(want_c, losses, d)
        got = math.fsum(a * loss for cs, ls in zip(got_c, losses, strict=True)
                        for a, loss in zip(cs, ls, strict=True)) / plan.denominator
        bound = 4 * UNIT * math.fsum(abs(a * loss) for cs, ls in zip(want_c, losses,
                                                                     strict=True)
                                     for a, loss in zip(cs, ls, strict=True)) / d
        assert abs(got - want) <= bound


def test_negative_control_a_per_microbatch_normaliser_is_not_the_window_objective():
    """Normalising each micro-batch by its own tokens and averaging (public trainers)
    gives other coefficients whenever micro-batches differ in size."""
    groups = [[(1.0, 0, 5), (0.0, 0, 1)], [(1.0, 0, 2), (0.0, 0, 2)]]
    plan, got = plan_of(groups, "none", "token_mean", split=1)
    samples = [[reference.Sample(*s) for s in g] for g in groups]
    want, d = reference.window_coefficients(samples, baseline="none", normalizer="token_mean")
    per_mb = [[a / len(c) / len(got) * d for a in c] for c in got]  # each row its own D
    assert any(abs(x - y) > 1e-3 for c, w in zip(per_mb, want, strict=True)
               for x, y in zip(c, w, strict=True))
    assert [[round(x, 6) for x in c] for c in got] == [[round(x, 6) for x in c] for c in want]


def test_the_group_mean_with_the_sample_is_not_leave_one_out():
    rewards = np.array([[1.0, 0.0, 0.0, 0.0]])
    _, loo = advantages(rewards, "leave_one_out", None, 1e-6)
    _, grpo = advantages(rewards, "group_mean_with_self", None, 1e-6)
    assert loo[0].tolist() == reference.advantages([1.0, 0.0, 0.0, 0.0], "leave_one_out")
    assert grpo[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert loo[0, 0] == 1.0 and grpo[0, 0] == 0.75  # (K - 1) / K of it


def test_a_window_with_nothing_to_learn_is_no_objective_with_its_cause():
    equal = [[(1.0, 0, 3), (1.0, 0, 2)]]  # leave-one-out: every advantage zero
    plan = policy_plan("token_mean", 1.0)(
        [PolicyRollouts.trajectory_batch(None, trajectories(equal, "leave_one_out", None), 0)],
        ObjectiveConfig())
    assert plan == NoObjective(NoObjectiveCause.ZERO_ADVANTAGE)
    nothing = [[(1.0, 0, 0), (0.0, 0, 0)]]  # nothing scored
    plan = policy_plan("token_mean", 1.0)(
        [PolicyRollouts.trajectory_batch(None, trajectories(nothing, "none", None), 0)],
        ObjectiveConfig())
    assert plan == NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)
    # control: one teacher-forced token is something to learn even with zero advantages
    forced = [[(1.0, 1, 3), (1.0, 1, 2)]]
    plan = policy_plan("token_mean", 1.0)(
        [PolicyRollouts.trajectory_batch(None, trajectories(forced, "leave_one_out", None), 0)],
        ObjectiveConfig())
    assert not isinstance(plan, NoObjective) and plan.denominator == 7.0


def test_coefficients_reach_the_engine_as_float32():
    plan, _ = plan_of([[(1.0, 0, 2), (0.0, 0, 2)]], "none", "token_mean", 4)
    assert all(c.dtype == torch.float32 for c in plan.coefficients)
