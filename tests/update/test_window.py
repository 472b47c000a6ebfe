"""The window transaction (U1-U4, U7), each promise with a negative control.

Every check is a small function that returns whether the promise holds; each is
run on the real engine (must pass) and on a deliberately wrong variant written
here (must fail), so none of these tests can pass vacuously.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from run_support import bitwise_differences
from update_support import (
    IGNORE_INDEX,
    Plan,
    TinyLM,
    assert_bitwise_equal,
    make_batch,
    make_engine,
    random_batch,
    snapshot,
    token_mean_plan,
    token_mean_terms,
)

from exactstep.config import load_config
from exactstep.objective.types import NoObjective
from exactstep.rows.batch import Batch
from exactstep.update import window as window_module
from exactstep.update.disposition import Outcome
from exactstep.update.window import CAUSE_INJECTED, LocalReducer, UpdateEngine

# ----------------------------------------------------------------------------- helpers


def pad_to(batch: Batch, length: int) -> Batch:
    """Right-pad a batch to ``length`` columns with unsupervised filler."""
    extra = length - batch.input_ids.shape[1]
    rows = [r + [1] * extra for r in batch.input_ids.tolist()]
    labels = [r + [IGNORE_INDEX] * extra for r in batch.labels.tolist()]
    return make_batch(rows, labels)


def concat(batches: list[Batch]) -> Batch:
    """One big batch holding every row of ``batches`` (padded to a common length)."""
    length = max(b.input_ids.shape[1] for b in batches)
    padded = [pad_to(b, length) for b in batches]
    return make_batch(
        [r for b in padded for r in b.input_ids.tolist()],
        [r for b in padded for r in b.labels.tolist()],
    )


def mean_of_means_plan(batches, cfg):
    """WRONG (U1): each microbatch's own token mean, divided by K."""
    k = len(batches)
    coefficients = [
        (b.labels != IGNORE_INDEX).float() / max(1, b.num_targets()) / k for b in batches
    ]
    tokens = sum(b.num_targets() for b in batches)
    return Plan(coefficients, 1.0, tokens)


def zero_loss_plan(batches, cfg):
    """WRONG (L4): an empty window becomes a zero loss and still steps."""
    plan = token_mean_plan(batches, cfg)
    if isinstance(plan, NoObjective):
        return Plan([torch.zeros(b.labels.shape) for b in batches], 1.0, 0)
    return plan


class FlagIgnoringReducer(LocalReducer):
    """WRONG (U4, D2): drops the non-finite flag, so every window commits."""

    def agree(self, values: torch.Tensor) -> torch.Tensor:  # [flag, S, NLL]
        return torch.cat([torch.zeros(1), values[1:]])


class ScheduleEveryWindowEngine(UpdateEngine):
    """WRONG (U5): advances the scheduler on every window, skipped or not."""

    def run_window(self, batches, window):
        disposition = super().run_window(batches, window)
        if disposition.outcome is not Outcome.COMMITTED:
            self.schedule.advance(0)
        return disposition


def params_after_one_window(batches: list[Batch], *, plan=token_mean_plan) -> list[torch.Tensor]:
    engine = make_engine(TinyLM(seed=3), optimizer="sgd", lr=1.0, momentum=0.0, accum=len(batches))
    engine.plan = plan
    disposition = engine.run_window(batches, 0)
    assert disposition.outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def accumulation_matches_big_batch(microbatches: list[Batch], *, plan=token_mean_plan) -> bool:
    """U1: K microbatches == one batch of all their rows (fp32, 1e-5)."""
    split = params_after_one_window(microbatches, plan=plan)
    whole = params_after_one_window([concat(microbatches)])
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    return max_difference(split, whole) <= 1e-5


def unequal_microbatches(seed: int = 0) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [
        random_batch(gen, 1, 6, supervised=0.3),
        random_batch(gen, 3, 9, supervised=0.9),
        random_batch(gen, 2, 4, supervised=0.6),
    ]


# ----------------------------------------------------------------------------- U1


def test_accumulation_equals_one_big_batch_u1():
    microbatches = unequal_microbatches()
    assert len({b.num_targets() for b in microbatches}) == 3  # genuinely unequal
    assert accumulation_matches_big_batch(microbatches)


def test_mean_of_microbatch_means_is_caught_u1():
    assert not accumulation_matches_big_batch(unequal_microbatches(), plan=mean_of_means_plan)


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 3), st.integers(2, 8), st.floats(0.2, 1.0)),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 10_000),
)
def test_accumulation_property_u1(sizes, seed):
    gen = torch.Generator().manual_seed(seed)
    batches = [random_batch(gen, rows, length, supervised=frac) for rows, length, frac in sizes]
    if sum(b.num_targets() for b in batches) == 0:
        return
    assert accumulation_matches_big_batch(batches)


def test_short_remainder_window_is_a_full_window_u1():
    """The last window of the data has fewer than K microbatches; still one update."""
    microbatches = unequal_microbatches(seed=5)[:2]
    engine = make_engine(TinyLM(seed=3), optimizer="sgd", lr=1.0, momentum=0.0, accum=4)
    disposition = engine.run_window(microbatches, 7)
    assert disposition.outcome is Outcome.COMMITTED
    assert disposition.microbatches == 2
    assert disposition.tokens == sum(b.num_targets() for b in microbatches)
    assert engine.microbatches == 2 and engine.committed == 1
    whole = params_after_one_window([concat(microbatches)])
    assert max_difference([p.detach() for p in engine.parameters], whole) <= 1e-5  # U1, as above


def window_token_mean(model, microbatches: list[Batch]) -> tuple[float, int]:
    """Plain PyTorch: cross entropy over every supervised row of the window at once."""
    with torch.no_grad():
        logits = torch.cat([(model(b) @ model.head_weight.t()).flatten(0, 1) for b in microbatches])
        labels = torch.cat([b.labels.flatten() for b in microbatches])
    supervised = labels != IGNORE_INDEX
    return float(F.cross_entropy(logits[supervised], labels[supervised])), int(supervised.sum())


def test_disposition_loss_is_window_objective_u1():
    microbatches = unequal_microbatches(seed=2)
    engine = make_engine(accum=3)
    expected, tokens = window_token_mean(engine.model, microbatches)
    d = engine.run_window(microbatches, 0)
    assert d.denominator == tokens and d.tokens == tokens
    assert d.loss == pytest.approx(expected, rel=1e-6)
    # negative control: the mean of microbatch means, reported by the same field
    wrong = make_engine(accum=3)
    wrong.plan = mean_of_means_plan
    assert wrong.run_window(microbatches, 0).loss != pytest.approx(expected, rel=1e-6)


# ----------------------------------------------------------------------------- U4: NO_OBJECTIVE


def empty_window() -> list[Batch]:
    return [
        make_batch([[1, 2, 3]], [[IGNORE_INDEX] * 3]),
        make_batch([[4, 5]], [[IGNORE_INDEX] * 2]),
    ]


def no_objective_changes_nothing(engine: UpdateEngine) -> bool:
    # one committed window first so that optimizer state exists
    gen = torch.Generator().manual_seed(0)
    engine.run_window([random_batch(gen, 2, 5)], 0)
    before = snapshot(engine)
    scaler_before = engine.precision.state_dict()
    disposition = engine.run_window(empty_window(), 1)
    try:
        assert_bitwise_equal(before, snapshot(engine))
    except AssertionError:
        return False
    return (
        disposition.outcome is Outcome.NO_OBJECTIVE
        and engine.precision.state_dict() == scaler_before
        and engine.no_objective == 1
        and engine.committed == 1
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_no_objective_window_changes_nothing_u4_l4(precision):
    engine = make_engine(precision=precision, init_scale=128.0, weight_decay=0.1)
    assert no_objective_changes_nothing(engine)


def test_zero_loss_variant_is_caught_u4_l4():
    engine = make_engine(precision="fp16", init_scale=128.0, weight_decay=0.1)
    engine.plan = zero_loss_plan
    assert not no_objective_changes_nothing(engine)


def test_no_objective_disposition_fields_u4():
    engine = make_engine()
    d = engine.run_window(empty_window(), 4)
    assert d.outcome is Outcome.NO_OBJECTIVE
    assert d.cause == "EMPTY_ELIGIBLE_SET"
    assert (d.lr, d.loss, d.grad_norm, d.tokens, d.denominator) == (None, None, None, 0, 0.0)
    assert engine.microbatches == 2


# ----------------------------------------------------------------------------- U2/U4: skips


def skip_leaves_state_unchanged(engine: UpdateEngine, batches: list[Batch], window: int) -> bool:
    before = snapshot(engine)
    scale_before = engine.precision.current_scale()
    disposition = engine.run_window(batches, window)
    try:
        assert_bitwise_equal(before, snapshot(engine))
    except AssertionError:
        return False
    backed_off = engine.precision.current_scale() < scale_before
    return (
        disposition.outcome is Outcome.SKIPPED_NONFINITE
        and disposition.lr is None
        and (backed_off or not engine.precision.uses_scaler)
    )


def run_until_commit(engine: UpdateEngine, gen: torch.Generator, window: int) -> tuple[int, int]:
    """Overflowing fp16 windows until one commits; checks every skip (U2, U4)."""
    skips = 0
    while True:
        batches = [random_batch(gen, 2, 6), random_batch(gen, 1, 4)]
        scale = engine.precision.current_scale()
        before = snapshot(engine)
        d = engine.run_window(batches, window)
        window += 1
        if d.outcome is Outcome.COMMITTED:
            return skips, window
        assert d.outcome is Outcome.SKIPPED_NONFINITE and d.cause is not None
        assert engine.precision.current_scale() == scale / 2  # back-off
        assert_bitwise_equal(before, snapshot(engine))
        skips += 1
        assert skips < 40


def test_fp16_overflow_skips_then_commits_after_backoff_u2_u4():
    engine = make_engine(precision="fp16", init_scale=2.0**24, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    skips, window = run_until_commit(engine, gen, 0)
    assert skips >= 1 and engine.committed == 1
    # overflow again, now with optimizer moments and a step count to protect
    engine.precision.scaler.update(new_scale=2.0**24)
    steps_before = {id(p): s["step"].clone() for p, s in engine.optimizer.state.items()}
    more_skips, _ = run_until_commit(engine, gen, window)
    assert more_skips >= 1
    assert engine.skipped == skips + more_skips and engine.committed == 2
    for p, s in engine.optimizer.state.items():
        assert int(s["step"]) == int(steps_before[id(p)]) + 1
    assert all(torch.isfinite(p).all() for p in engine.parameters)


def test_ignoring_the_finite_flag_is_caught_u4():
    engine = make_engine(precision="fp16", init_scale=2.0**30)
    engine.reducer = FlagIgnoringReducer()
    gen = torch.Generator().manual_seed(1)
    assert not skip_leaves_state_unchanged(engine, [random_batch(gen, 2, 6)], 0)


def test_fault_injection_skips_the_chosen_window_u4():
    cfg = load_config(overrides=["update.fail_window=1"]).update
    assert cfg.fail_window == 1
    engine = make_engine(fail_window=cfg.fail_window)
    gen = torch.Generator().manual_seed(2)
    outcomes = []
    for w in range(3):
        batches = [random_batch(gen, 2, 5)]
        if w == 1:
            assert skip_leaves_state_unchanged(engine, batches, w)
            outcomes.append(Outcome.SKIPPED_NONFINITE)
        else:
            outcomes.append(engine.run_window(batches, w).outcome)
    assert outcomes == [Outcome.COMMITTED, Outcome.SKIPPED_NONFINITE, Outcome.COMMITTED]
    # negative control: the same window without injection commits
    control = make_engine()
    assert control.run_window([random_batch(gen, 2, 5)], 1).outcome is Outcome.COMMITTED


def test_injected_fault_cause_is_recorded_u4():
    engine = make_engine(fail_window=0)
    d = engine.run_window([random_batch(torch.Generator().manual_seed(0), 1, 4)], 0)
    assert d.cause == CAUSE_INJECTED
    assert math.isnan(d.grad_norm)
    assert d.ledger_record()["grad_norm"] == "nan"


# ----------------------------------------------------------------------------- U5 on skips


def cosine_lr(c: int, *, peak: float = 6e-3, warmup: int = 2, horizon: int = 6) -> float:
    """U5 cosine written out (floor 0.1 of the peak): the rate of the update at count c."""
    if c < warmup:
        return peak * (c + 1) / warmup
    p = min(1.0, (c - warmup) / (horizon - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def schedule_counts_only_commits(engine: UpdateEngine) -> bool:
    """Committed windows use the closed-form rate of the committed count (6e-3 peak,
    warmup 2, horizon 6); window 2 is a skip and must not advance it."""
    gen = torch.Generator().manual_seed(4)
    used = []
    for w in range(5):
        d = engine.run_window([random_batch(gen, 2, 5)], w)
        if d.outcome is Outcome.COMMITTED:
            used.append(d.lr)
    expected = [cosine_lr(c) for c in range(len(used))]
    return used == pytest.approx(expected, rel=1e-12) and engine.committed == 4


def test_scheduler_does_not_advance_on_skipped_window_u4_u5():
    engine = make_engine(fail_window=2, schedule="cosine", warmup=2, total_windows=6)
    assert schedule_counts_only_commits(engine)


def test_scheduler_stepping_every_window_is_caught_u5():
    engine = make_engine(
        fail_window=2,
        schedule="cosine",
        warmup=2,
        total_windows=6,
        engine_cls=ScheduleEveryWindowEngine,
    )
    assert not schedule_counts_only_commits(engine)


def noam_lrs(engine: UpdateEngine) -> tuple[list[float], list[float]]:
    """(rates used, Noam closed form of the committed tokens before each window)."""
    gen = torch.Generator().manual_seed(6)
    used, expected, tokens = [], [], 0
    for w in range(3):
        batches = [random_batch(gen, 2, 5)]
        s = tokens + 1  # U5: s = c + 1 on the tokens clock; peak 6e-3, W = 10
        expected.append(6e-3 * min(s / 10, math.sqrt(10 / s)))
        used.append(engine.run_window(batches, w).lr)
        tokens += sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    return used, expected


def test_token_clock_advances_by_committed_tokens_u5():
    engine = make_engine(schedule="noam", warmup=10, clock="tokens", decay_steps=1000)
    used, expected = noam_lrs(engine)
    assert used == pytest.approx(expected, rel=1e-12)
    # negative control: the same schedule on the updates clock fails the check
    wrong = make_engine(schedule="noam", warmup=10, clock="updates", decay_steps=1000)
    assert noam_lrs(wrong)[0] != pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- U3: clip order


def reference_normalized_gradient(engine: UpdateEngine, batches: list[Batch]) -> list[torch.Tensor]:
    """fp32 autograd of (sum of numerators) / D over the engine's unique parameters."""
    model, params = engine.model, engine.parameters
    plan = token_mean_plan(batches, None)
    total = sum(
        token_mean_terms(model(b), model.head_weight, b.labels, c, None, pad_id=0)[0]
        for b, c in zip(batches, plan.coefficients, strict=True)
    )
    return list(torch.autograd.grad(total / plan.denominator, params))


class ClipBeforeUnscalePrecision:
    """WRONG (U3): clips the still-scaled gradient, then unscales it."""

    def __init__(self, inner, params, cap):
        self.inner, self.params, self.cap = inner, params, cap

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def unscale_(self, optimizer):
        torch.nn.utils.clip_grad_norm_(self.params, self.cap)
        self.inner.unscale_(optimizer)


def clip_sees_true_gradient(engine: UpdateEngine, batches: list[Batch], cap: float) -> bool:
    """With SGD(lr=1) the update is minus the clipped gradient: check it (fp16 tolerance)."""
    g = reference_normalized_gradient(engine, batches)
    true_norm = float(torch.linalg.vector_norm(torch.stack([x.norm() for x in g])))
    assert true_norm > cap  # the clip must bite for the check to mean something
    expected = [-x * (cap / true_norm) for x in g]
    before = [p.detach().clone() for p in engine.parameters]
    d = engine.run_window(batches, 0)
    delta = [p.detach() - b for p, b in zip(engine.parameters, before, strict=True)]
    flat_delta = torch.cat([x.flatten() for x in delta])
    flat_expected = torch.cat([x.flatten() for x in expected])
    rel_error = float((flat_delta - flat_expected).norm() / flat_expected.norm())
    # fp16 keeps 11 bits (u = 2**-11 = 4.9e-4 per rounding): 2e-2 is ~40 such roundings;
    # fp32 rounds it to a few 1e-6 (a small step subtracted from O(1) parameters)
    return (
        d.outcome is Outcome.COMMITTED
        and rel_error < 2e-2
        and d.grad_norm == pytest.approx(true_norm, rel=2e-2)
    )


def clip_engine(precision: str) -> tuple[UpdateEngine, list[Batch]]:
    engine = make_engine(
        TinyLM(seed=9, tied=False),
        precision=precision,
        init_scale=1024.0,
        optimizer="sgd",
        lr=1.0,
        momentum=0.0,
        clip=0.05,
        accum=2,
    )
    return engine, unequal_microbatches(seed=8)[:2]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_clip_sees_unscaled_normalized_gradient_u3(precision):
    engine, batches = clip_engine(precision)
    assert clip_sees_true_gradient(engine, batches, 0.05)


def test_clip_before_unscale_is_caught_u3():
    engine, batches = clip_engine("fp16")
    engine.precision = ClipBeforeUnscalePrecision(engine.precision, engine.parameters, 0.05)
    assert not clip_sees_true_gradient(engine, batches, 0.05)


def test_grad_norm_is_of_normalized_gradient_u3():
    """The reported pre-clip norm is the norm of d(S/D), fp32, 1e-5; an unnormalized
    (sum) objective is caught."""
    batches = unequal_microbatches(seed=11)
    engine = make_engine(TinyLM(seed=1), accum=3, clip=1.0)
    g = reference_normalized_gradient(engine, batches)
    true_norm = float(torch.linalg.vector_norm(torch.stack([x.norm() for x in g])))
    # U3's fp32 1e-5: the norm of the same gradient accumulated in another order; its
    # entries round to ~1e-7 relatively, so does the norm (a sum of squares)
    assert engine.run_window(batches, 0).grad_norm == pytest.approx(true_norm, rel=1e-5)

    def sum_plan(bs, cfg):
        plan = token_mean_plan(bs, cfg)
        return Plan(plan.coefficients, 1.0, plan.tokens)

    wrong = make_engine(TinyLM(seed=1), accum=3, clip=1.0)
    wrong.plan = sum_plan
    assert wrong.run_window(batches, 0).grad_norm != pytest.approx(true_norm, rel=1e-5)


# ----------------------------------------------------------------------------- worked numbers


class VectorModel(torch.nn.Module):
    """Two separate parameters whose objective's gradient is exactly (6, 8)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(1))
        self.b = torch.nn.Parameter(torch.zeros(1))

    @property
    def head_weight(self):
        return self.a

    def forward(self, batch):
        return batch.input_ids.float()


def six_eight_terms(hidden, head_weight, labels, coeff, cfg, *, pad_id):
    model_b = six_eight_terms.model.b
    numerator = (6.0 * head_weight.sum() + 8.0 * model_b.sum()) * coeff.sum()
    return numerator, numerator.detach()


def clipped_update_of_six_eight(monkeypatch=None, per_tensor: bool = False) -> list[float]:
    model = VectorModel()
    six_eight_terms.model = model
    engine = make_engine(model, optimizer="sgd", lr=1.0, momentum=0.0, clip=2.0)
    engine.train_module.terms = six_eight_terms
    if per_tensor:

        def clip_each(params, cap, norm):  # WRONG: per-tensor clipping
            for p in params:
                torch.nn.utils.clip_grad_norm_([p], cap)

        monkeypatch.setattr(window_module, "clip_grads_with_norm_", clip_each)
    d = engine.run_window([make_batch([[1]], [[1]])], 0)
    assert d.grad_norm == pytest.approx(10.0)
    return [-float(model.a.detach()), -float(model.b.detach())]


def test_worked_clip_numbers_u3():
    """Reference worked numbers: (6, 8) with cap 2 -> (1.2, 1.6)."""
    assert clipped_update_of_six_eight() == pytest.approx([1.2, 1.6], abs=1e-6)


def test_per_tensor_clip_is_caught_u3(monkeypatch):
    wrong = clipped_update_of_six_eight(monkeypatch, per_tensor=True)
    assert wrong == pytest.approx([2.0, 2.0], abs=1e-5)  # each tensor capped on its own
    assert wrong != pytest.approx([1.2, 1.6], abs=1e-6)


# ----------------------------------------------------------------------------- state


def resumable_engine(model: TinyLM) -> UpdateEngine:
    """fp16 with clipping, decay, a warmup schedule and a skip at window 1 (the scale
    backs off before the state is saved): every piece of state matters."""
    return make_engine(model, precision="fp16", init_scale=4096.0, accum=2, schedule="cosine",
                       warmup=1, clip=0.5, weight_decay=0.1, fail_window=1)


def engine_state(engine: UpdateEngine) -> dict:
    return {"params": [p.detach().clone() for p in engine.parameters],
            **copy.deepcopy(engine.state_dict())}


def test_state_dict_round_trip_continues_bitwise_s2():
    gen = torch.Generator().manual_seed(12)
    windows = [[random_batch(gen, 2, 5), random_batch(gen, 1, 7)] for _ in range(4)]
    straight = resumable_engine(TinyLM(seed=2))
    for w, batches in enumerate(windows):
        straight.run_window(batches, w)

    first = resumable_engine(TinyLM(seed=2))
    for w, batches in enumerate(windows[:2]):
        first.run_window(batches, w)
    state = copy.deepcopy(first.state_dict())
    assert state["precision"]["scaler"]["scale"] == 2048.0  # 4096 x 0.5 after the skip
    assert state["counters"]["skipped"] == 1
    weights = {k: v.clone() for k, v in first.model.state_dict().items()}

    def resumed(drop: tuple[str, ...] = ()) -> UpdateEngine:
        model = TinyLM(seed=2)
        model.load_state_dict(weights)
        engine = resumable_engine(model)
        fresh = engine.state_dict()
        engine.load_state_dict({k: fresh[k] if k in drop else v for k, v in state.items()})
        for w, batches in enumerate(windows[2:], start=2):
            engine.run_window(batches, w)
        return engine

    assert bitwise_differences(engine_state(resumed()), engine_state(straight)) == []
    # negative controls: drop the optimizer + schedule state, or only the scaler's
    lost = bitwise_differences(engine_state(resumed(("optimizer", "schedule"))),
                               engine_state(straight))
    assert any(d.startswith("params") for d in lost)
    no_scaler = bitwise_differences(engine_state(resumed(("precision",))), engine_state(straight))
    assert "precision.scaler.scale" in no_scaler
