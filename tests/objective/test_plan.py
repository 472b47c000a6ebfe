"""Window plans: S/D coefficients of every reduction (L3) and NoObjective (L4)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from equivalence import linear_cross_entropy_bounds, smoothed_targets
from hypothesis import given, settings
from hypothesis import strategies as st
from objective_batches import X, make_batch

from exactstep.errors import ObjectiveError
from exactstep.objective import (
    NoObjective,
    NoObjectiveCause,
    ObjectiveConfig,
    WindowPlan,
    microbatch_terms,
    no_objective,
    plan_window,
)
from exactstep.rows.batch import IGNORE_INDEX


def objective_value(plan: WindowPlan, losses: list[torch.Tensor]) -> float:
    """``S / D`` for given per-row losses ``c_r`` ([B, T] per microbatch)."""
    numerator = sum(float((a * c).sum()) for a, c in zip(plan.coefficients, losses, strict=True))
    return numerator / plan.denominator


def plan(batches, reduction="token_mean", **kwargs):
    return plan_window(batches, ObjectiveConfig(reduction=reduction), **kwargs)


# ------------------------------------------------------------ the worked numbers


def test_window_token_mean_is_3_where_mean_of_microbatch_means_is_3_5():
    # microbatch 0: one row with two targets of loss 2; microbatch 1: one target of loss 5
    batches = [make_batch([[1, 1, X]]), make_batch([[1, X, X]])]
    losses = [torch.tensor([[2.0, 2.0, 0.0]]), torch.tensor([[5.0, 0.0, 0.0]])]
    p = plan(batches)
    assert p.denominator == 3 and p.tokens == 3
    assert objective_value(p, losses) == pytest.approx(3.0)
    # negative control: each microbatch's mean divided by K is the other objective
    wrong = sum(float(c.sum()) / b.num_targets() for c, b in zip(losses, batches, strict=True)) / 2
    assert wrong == pytest.approx(3.5)
    # microbatch_mean *declares* that other objective, and the plan realises it
    assert objective_value(plan(batches, "microbatch_mean"), losses) == pytest.approx(3.5)


def test_accumulated_window_equals_one_big_batch_token_mean():
    """Unequal microbatches: sum of S_m over D_W equals F.cross_entropy of the union."""
    g = torch.Generator().manual_seed(0)
    V, H = 11, 6
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    lab0 = [[3, 4, X, X, X, X], [X, X, X, X, X, X]]
    lab1 = [[1, 2, 3, 4, 5, 6], [7, 8, 9, X, X, X]]
    batches = [make_batch(lab0), make_batch(lab1)]
    hidden = [torch.randn(2, 6, H, generator=g) for _ in batches]
    p = plan(batches)
    cfg = ObjectiveConfig(chunk_rows=4)
    total = sum(
        microbatch_terms(h, weight, b.labels, a, cfg, pad_id=None, rows_index=idx)[0]
        for h, b, a, idx in zip(hidden, batches, p.coefficients, p.row_indices, strict=True)
    )
    objective = total / p.denominator
    union_h = torch.cat([h.reshape(-1, H) for h in hidden])
    union_y = torch.cat([b.labels.reshape(-1) for b in batches])
    want = F.cross_entropy(union_h @ weight.T, union_y)
    # both sides round: twice the worst-case fp32 bound of the token mean of the union's
    # rows and of its weight gradient, whatever the chunking (tests/equivalence.py)
    supervised = (union_y != IGNORE_INDEX).double() / p.denominator
    bound, _, grad_bound = linear_cross_entropy_bounds(
        union_h, weight.detach(), smoothed_targets(union_y, V, 0.0, IGNORE_INDEX), supervised)
    assert abs(objective.item() - want.item()) <= 2 * bound
    (g_ours,) = torch.autograd.grad(objective, weight)
    (g_want,) = torch.autograd.grad(want, weight)
    assert ((g_ours.double() - g_want.double()).abs() <= 2 * grad_bound).all()
    # negative control: the same path with the per-microbatch mean (divided by K)
    # fails the same comparison with the union's token mean
    q = plan(batches, "microbatch_mean")
    wrong = sum(
        microbatch_terms(h, weight, b.labels, a, cfg, pad_id=None, rows_index=idx)[0]
        for h, b, a, idx in zip(hidden, batches, q.coefficients, q.row_indices, strict=True)
    ) / q.denominator
    assert abs(wrong.item() - want.item()) > 2 * bound


# ---------------------------------------------------------------- each reduction


def test_token_mean_coefficients_are_the_supervision_mask():
    batch = make_batch([[1, X, 2], [X, X, 3]])
    p = plan([batch])
    assert torch.equal(p.coefficients[0], (batch.labels != IGNORE_INDEX).float())
    assert p.denominator == 3.0 and p.microbatch_denominators == [3.0]
    assert p.row_indices[0].tolist() == [0, 2, 5]
    assert p.coefficients[0].dtype == torch.float32 and p.coefficients[0].device.type == "cpu"


def test_sequence_mean_counts_documents_not_physical_rows():
    # example 7 is split: piece 0 at the end of row 0 of microbatch 0 (packed after
    # example 3), piece 1 at the start of row 0 of microbatch 1, beside example 9.
    mb0 = make_batch([[1, 1, X, 1, 1, 1]], segments=[[(3, 0, 0, 3), (7, 0, 3, 3)]])
    mb1 = make_batch([[1, X, 1, 1, X, X]], segments=[[(7, 1, 0, 2), (9, 0, 2, 2)]])
    p = plan([mb0, mb1], "sequence_mean")
    assert p.denominator == 3.0  # documents 3, 7, 9
    a0, a1 = p.coefficients
    assert a0[0, :2].tolist() == [0.5, 0.5]  # example 3: 2 targets
    assert a0[0, 3:].tolist() == pytest.approx([0.25] * 3)  # example 7: 3 + 1 targets
    assert a1[0, 0].item() == pytest.approx(0.25)
    assert a1[0, 2:4].tolist() == [0.5, 0.5]
    assert math.fsum(p.microbatch_denominators) == pytest.approx(3.0)
    # document means 1, 2 and 3 -> objective 2
    losses = [
        torch.tensor([[1.0, 1.0, 0, 2.0, 2.0, 2.0]]),
        torch.tensor([[2.0, 0, 3.0, 3.0, 0, 0]]),
    ]
    assert objective_value(p, losses) == pytest.approx(2.0)
    # negative control: a plan that averages per physical pack (each microbatch row is
    # one "sequence") fails the same check
    per_pack = SimpleNamespace(
        coefficients=[(b.labels != IGNORE_INDEX).float() / b.num_targets() for b in (mb0, mb1)],
        denominator=2.0,
    )
    assert objective_value(per_pack, losses) != pytest.approx(2.0)


def test_microbatch_mean_ignores_empty_microbatches():
    batches = [make_batch([[1, 1, X]]), make_batch([[X, X, X]]), make_batch([[1, 1, 1]])]
    p = plan(batches, "microbatch_mean")
    assert p.denominator == 2.0
    assert p.coefficients[0][0].tolist() == [0.5, 0.5, 0.0]
    assert torch.all(p.coefficients[1] == 0)
    assert p.coefficients[2][0].tolist() == pytest.approx([1 / 3] * 3)


def test_weighted_is_self_normalised_and_weighted_count_divides_by_rows():
    batch = make_batch([[1, 1, X], [1, X, X]], weights=[[2.0, 1.0, 9.0], [0.5, 9.0, 9.0]])
    p = plan([batch], "weighted")
    assert p.denominator == pytest.approx(3.5)  # weights on unsupervised rows ignored
    assert p.coefficients[0].tolist() == [[2.0, 1.0, 0.0], [0.5, 0.0, 0.0]]
    q = plan([batch], "weighted_count")
    assert q.denominator == 3.0
    assert torch.equal(q.coefficients[0], p.coefficients[0])


# ---------------------------------------------------------------------- L4


def test_no_supervised_row_is_empty_eligible_set():
    batches = [make_batch([[X, X]]), make_batch([[X, X]])]
    for reduction in ("token_mean", "sequence_mean", "microbatch_mean"):
        out = plan(batches, reduction)
        assert out == NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)


def test_zero_weight_mass_is_its_own_cause():
    batch = make_batch([[1, 1]], weights=[[0.0, 0.0]])
    assert plan([batch], "weighted") == NoObjective(NoObjectiveCause.NONEMPTY_ZERO_WEIGHT_MASS)
    # weighted_count still has D = 2: an objective whose numerator is 0
    assert isinstance(plan([batch], "weighted_count"), WindowPlan)


def test_a_locally_empty_microbatch_is_normal():
    p = plan([make_batch([[X, X]]), make_batch([[1, X]])])
    assert isinstance(p, WindowPlan) and p.denominator == 1.0
    assert p.microbatch_denominators == [0.0, 1.0] and p.microbatch_tokens == [0, 1]


def test_allow_empty_returns_a_zero_plan_and_defers_the_decision():
    p = plan([make_batch([[X, X]])], allow_empty=True)
    assert isinstance(p, WindowPlan) and p.denominator == 0.0 and p.tokens == 0
    assert no_objective(p.denominator, p.tokens).cause is NoObjectiveCause.EMPTY_ELIGIBLE_SET
    assert no_objective(0.0, 5).cause is NoObjectiveCause.NONEMPTY_ZERO_WEIGHT_MASS
    assert no_objective(3.0, 5) is None


def test_empty_window_is_no_objective():
    assert plan([]) == NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)


# -------------------------------------------------------------------- errors


def test_weighted_without_weights_is_a_typed_error():
    with pytest.raises(ObjectiveError, match="weights"):
        plan([make_batch([[1, 1]])], "weighted")


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_weight_names_the_example(bad):
    batch = make_batch([[1, 1]], segments=[[(42, 0, 0, 2)]], weights=[[1.0, bad]])
    with pytest.raises(ObjectiveError, match="example 42"):
        plan([batch], "weighted")


def test_sequence_mean_needs_an_address_on_every_supervised_row():
    batch = make_batch([[1, 1, 1]], segments=[[(0, 0, 0, 2)]])
    with pytest.raises(ObjectiveError, match="no segment"):
        plan([batch], "sequence_mean")
    assert isinstance(plan([batch], "token_mean"), WindowPlan)  # others do not need it


def test_unknown_reduction_is_a_typed_error():
    cfg = ObjectiveConfig.__new__(ObjectiveConfig)
    object.__setattr__(cfg, "reduction", "median")
    with pytest.raises(ObjectiveError, match="reduction"):
        plan_window([make_batch([[1]])], cfg)


# ------------------------------------------------------------ properties


@st.composite
def windows(draw):
    T = draw(st.integers(1, 6))
    K = draw(st.integers(1, 3))
    batches = []
    example = 0
    for _ in range(K):
        B = draw(st.integers(1, 3))
        labels = [[draw(st.sampled_from([X, 1, 2])) for _ in range(T)] for _ in range(B)]
        segs = []
        for _ in range(B):
            cut = draw(st.integers(0, T))
            row = [(draw(st.integers(0, 4)), 0, 0, cut)] if cut else []
            if cut < T:
                row.append((draw(st.integers(0, 4)), 1, cut, T - cut))
            segs.append(row)
            example += 1
        weights = [
            [draw(st.sampled_from([0.0, 0.5, 1.0, 3.0])) for _ in range(T)] for _ in range(B)
        ]
        batches.append(make_batch(labels, segs, weights))
    return batches


@settings(max_examples=60, deadline=None)
@given(
    windows(),
    st.sampled_from(
        ["token_mean", "sequence_mean", "microbatch_mean", "weighted", "weighted_count"]
    ),
)
def test_plan_invariants(batches, reduction):
    p = plan(batches, reduction)
    tokens = sum(b.num_targets() for b in batches)
    if isinstance(p, NoObjective):
        assert (tokens == 0) == (p.cause is NoObjectiveCause.EMPTY_ELIGIBLE_SET)
        return
    assert p.tokens == tokens
    assert math.fsum(p.microbatch_denominators) == pytest.approx(p.denominator)
    for a, b in zip(p.coefficients, batches, strict=True):
        assert torch.all(a[b.labels == IGNORE_INDEX] == 0) and torch.all(a >= 0)
    # self-normalised reductions: a constant loss c gives S / D = c
    if reduction != "weighted_count":
        constant = [torch.full(b.labels.shape, 2.5) for b in batches]
        assert objective_value(p, constant) == pytest.approx(2.5)


@settings(max_examples=40, deadline=None)
@given(windows(), st.sampled_from(["token_mean", "sequence_mean", "weighted", "weighted_count"]))
def test_regrouping_microbatches_keeps_the_objective(batches, reduction):
    """Accumulation invariance: the same rows in one microbatch give the same S / D."""
    T = batches[0].labels.shape[1]
    merged = make_batch(
        torch.cat([b.labels for b in batches]).tolist(),
        [
            [(s.example_id, s.piece, s.start, s.length) for s in row]
            for b in batches
            for row in b.segments
        ],
        torch.cat([b.weights for b in batches]).tolist(),
    )
    split, whole = plan(batches, reduction), plan([merged], reduction)
    if isinstance(split, NoObjective):
        assert whole == split
        return
    g = torch.Generator().manual_seed(T)
    losses = [torch.rand(b.labels.shape, generator=g) for b in batches]
    assert objective_value(split, losses) == pytest.approx(
        objective_value(whole, [torch.cat(losses)]), rel=1e-6
    )
