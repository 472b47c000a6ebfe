"""Mixed precision inside the window (U2): where autocast applies, one unscale per window."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from update_support import make_engine, random_batch

from exactstep.update.config import NumericsConfig
from exactstep.update.disposition import Outcome
from exactstep.update.precision import Precision
from exactstep.update.schedule import Schedule


def window_batches(k: int = 3):
    gen = torch.Generator().manual_seed(0)
    return [random_batch(gen, 2, 5) for _ in range(k)]


class Recorder:
    """Records whether autocast is on during forward, backward and optimizer step."""

    def __init__(self, engine):
        self.seen: dict[str, set[bool]] = {"forward": set(), "backward": set(), "step": set()}
        model = engine.model
        model.register_forward_hook(lambda *a: self._note("forward"))
        model.proj.weight.register_hook(lambda g: self._note("backward"))
        engine.optimizer.register_step_pre_hook(lambda *a: self._note("step"))

    def _note(self, phase: str) -> None:
        self.seen[phase].add(torch.is_autocast_enabled("cpu"))


class WholeWindowAutocast(Precision):
    """WRONG (U2): leaves autocast on for the backward and the optimizer step too."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._outer = None

    @contextlib.contextmanager
    def autocast(self):
        if self._outer is None:
            self._outer = torch.autocast("cpu", dtype=torch.bfloat16)
            self._outer.__enter__()
        yield


def autocast_only_around_forward(engine) -> bool:
    recorder = Recorder(engine)
    try:
        assert engine.run_window(window_batches(), 0).outcome is Outcome.COMMITTED
    finally:
        outer = getattr(engine.precision, "_outer", None)
        if outer is not None:
            outer.__exit__(None, None, None)
    return recorder.seen == {"forward": {True}, "backward": {False}, "step": {False}}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_covers_forward_and_loss_only_u2(precision):
    assert autocast_only_around_forward(make_engine(precision=precision, accum=3))


def test_autocast_left_on_is_caught_u2():
    engine = make_engine(precision="bf16", accum=3)
    engine.precision = WholeWindowAutocast(NumericsConfig(precision="bf16"), "cpu")
    assert not autocast_only_around_forward(engine)


def test_fp32_runs_without_autocast_u2():
    engine = make_engine(precision="fp32", accum=3)
    recorder = Recorder(engine)
    engine.run_window(window_batches(), 0)
    assert recorder.seen["forward"] == {False}


def count_unscales(engine) -> int:
    calls = []
    original = engine.precision.scaler.unscale_

    def counted(optimizer):
        calls.append(optimizer)
        return original(optimizer)

    engine.precision.scaler.unscale_ = counted
    engine.run_window(window_batches(3), 0)
    return len(calls)


def test_fp16_unscales_exactly_once_per_window_u2():
    engine = make_engine(precision="fp16", init_scale=256.0, accum=3)
    assert count_unscales(engine) == 1


def test_per_microbatch_unscale_is_caught_u2():
    """Negative control: unscaling inside the microbatch loop is counted K times."""
    engine = make_engine(precision="fp16", init_scale=256.0, accum=3)
    original_scale = engine.precision.scale

    def scale_then_unscale(loss):  # WRONG: unscale after every microbatch
        scaled = original_scale(loss)
        scaled.register_hook(lambda g: engine.precision.scaler.unscale_(engine.optimizer))
        return scaled

    engine.precision.scale = scale_then_unscale
    with pytest.raises(RuntimeError, match="unscale_"):
        count_unscales(engine)  # torch refuses a second unscale_ before update


def test_scaler_state_round_trip_u2_s2():
    """A scale that moved (one skip: x0.5; then two commits: tracker 2) survives
    state_dict/load_state_dict; a fresh scaler is the negative control."""
    engine = make_engine(precision="fp16", init_scale=512.0, fail_window=0)
    outcomes = [engine.run_window(window_batches(1), w).outcome for w in range(3)]
    assert outcomes == [Outcome.SKIPPED_NONFINITE, Outcome.COMMITTED, Outcome.COMMITTED]
    state = engine.precision.state_dict()
    assert (state["scaler"]["scale"], state["scaler"]["_growth_tracker"]) == (256.0, 2)

    def scale_and_tracker(precision: Precision) -> tuple[float, int]:
        return precision.current_scale(), precision.state_dict()["scaler"]["_growth_tracker"]

    loaded = Precision(NumericsConfig(precision="fp16", init_scale=512.0), "cpu")
    fresh = Precision(NumericsConfig(precision="fp16", init_scale=512.0), "cpu")
    loaded.load_state_dict(state)
    assert scale_and_tracker(loaded) == (256.0, 2)
    assert scale_and_tracker(fresh) != (256.0, 2)
    assert Precision(NumericsConfig(precision="bf16"), "cpu").state_dict()["scaler"] == {}


def cosine(c: int, *, peak: float, warmup: int, horizon: int, floor: float) -> float:
    """U5 cosine written out: linear warmup to ``peak``, then half a cosine to ``floor``."""
    if c < warmup:
        return peak * (c + 1) / warmup
    p = min(1.0, (c - warmup) / (horizon - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


class AheadSchedule(Schedule):
    """WRONG (U5): the rate of the update after the one being taken (stepped early)."""

    def lr(self) -> float:
        return self.lr_at(self.clock_value + 1)


def lrs_seen_by_the_optimizer(engine) -> tuple[list[float], list]:
    seen: list[float] = []
    engine.optimizer.register_step_pre_hook(
        lambda opt, *a: seen.append({g["lr"] for g in opt.param_groups}.pop()))
    gen = torch.Generator().manual_seed(1)
    recorded = [engine.run_window([random_batch(gen, 2, 5)], w).lr for w in range(5)]
    return seen, recorded


def test_lr_recorded_is_the_lr_the_optimizer_used_u4_u5():
    """The rate each optimizer step used (read in a step pre-hook) is the ledger's lr and
    the closed-form schedule of the committed count (lr 6e-3, warmup 3, 8 windows)."""
    expected = [cosine(c, peak=6e-3, warmup=3, horizon=8, floor=0.1) for c in range(5)]
    engine = make_engine(schedule="cosine", warmup=3, total_windows=8)
    seen, recorded = lrs_seen_by_the_optimizer(engine)
    assert seen == recorded
    assert recorded == pytest.approx(expected, rel=1e-12)
    # negative control: a schedule stepped one update early fails the same check
    wrong = make_engine(schedule="cosine", warmup=3, total_windows=8)
    wrong.schedule.__class__ = AheadSchedule
    seen, recorded = lrs_seen_by_the_optimizer(wrong)
    assert recorded != pytest.approx(expected, rel=1e-12)
