"""Learning-rate schedules on a declared clock (U5): worked values and properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.update.config import UpdateConfig
from exactstep.update.schedule import Schedule, build_schedule

FAMILIES = ["constant", "cosine", "wsd", "noam", "inverse_sqrt"]


def schedule(
    family: str,
    *,
    clock: str = "updates",
    warmup: int = 10,
    horizon: int = 110,
    min_lr_ratio: float = 0.1,
    decay_fraction: float = 0.2,
) -> Schedule:
    cfg = UpdateConfig(
        lr=1.0,
        schedule=family,
        clock=clock,
        warmup=warmup,
        min_lr_ratio=min_lr_ratio,
        decay_fraction=decay_fraction,
        decay_steps=horizon,
    )
    return build_schedule(cfg, total_windows=1)


@pytest.mark.parametrize("clock", ["updates", "tokens"])
def test_worked_values_u5(clock):
    """Closed-form values; the same function of the clock value on either clock."""
    cos = schedule("cosine", clock=clock)
    assert cos.lr_at(0) == pytest.approx(0.1)  # warmup: (c + 1) / W
    assert cos.lr_at(9) == pytest.approx(1.0)
    assert cos.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert cos.lr_at(110) == pytest.approx(0.1)
    assert cos.lr_at(500) == pytest.approx(0.1)

    const = schedule("constant", clock=clock)
    assert const.lr_at(4) == pytest.approx(0.5) and const.lr_at(1000) == 1.0

    wsd = schedule("wsd", clock=clock, horizon=100, decay_fraction=0.2)
    assert wsd.lr_at(50) == 1.0 and wsd.lr_at(79) == 1.0  # stable until 80
    assert wsd.lr_at(90) == pytest.approx(1.0 - 0.9 * 0.5)
    assert wsd.lr_at(100) == pytest.approx(0.1)

    noam = schedule("noam", clock=clock, warmup=100)
    assert noam.lr_at(49) == pytest.approx(0.5)  # linear: s / W
    assert noam.lr_at(99) == pytest.approx(1.0)  # peak at s = W
    assert noam.lr_at(399) == pytest.approx(0.5)  # sqrt(W / s)

    inv = schedule("inverse_sqrt", clock=clock, warmup=100)
    assert inv.lr_at(0) == 1.0 and inv.lr_at(99) == 1.0  # flat, no ramp
    assert inv.lr_at(399) == pytest.approx(0.5)


def test_noam_matches_the_transformer_formula_u5():
    """Rescaled Noam: proportional to d^-0.5 * min(s^-0.5, s * W^-1.5) at every step."""
    w, d = 40, 64
    noam = schedule("noam", warmup=w)
    raw = [d**-0.5 * min(s**-0.5, s * w**-1.5) for s in range(1, 300)]
    ratio = [noam.lr_at(s - 1) / r for s, r in zip(range(1, 300), raw, strict=True)]
    assert max(ratio) == pytest.approx(min(ratio), rel=1e-12)


def closed_form(family: str, c: int, *, warmup: int = 10, horizon: int = 110,
                floor: float = 0.1, fraction: float = 0.2) -> float:
    """Each family at clock value ``c`` with peak 1, written from U5 (``s = c + 1``)."""
    s = c + 1
    ramp = min(1.0, s / warmup)
    if family == "constant":
        return ramp
    if family == "noam":
        return min(s / warmup, math.sqrt(warmup / s))
    if family == "inverse_sqrt":
        return math.sqrt(warmup / max(s, warmup))
    if c < warmup:
        return ramp
    if family == "cosine":
        p = min(1.0, (c - warmup) / (horizon - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
    start = horizon - round(fraction * horizon)  # wsd: flat, then linear to the floor
    if c < start:
        return 1.0
    return floor + (1 - floor) * (1 - min(1.0, (c - start) / (horizon - start)))


class UpdatesOnlyClock(Schedule):
    """WRONG (U5): reads the updates counter whatever clock was declared."""

    @property
    def clock_value(self) -> int:
        return self.updates


@pytest.mark.parametrize("family", FAMILIES)
def test_clocks_differ_only_in_what_they_count_u5(family):
    """7 committed updates of 13 tokens each: the updates clock reads 7, the tokens
    clock 91, and each rate is the family's closed form at that reading."""
    by_updates = schedule(family, clock="updates")
    by_tokens = schedule(family, clock="tokens")
    wrong = schedule(family, clock="tokens")
    wrong.__class__ = UpdatesOnlyClock
    for s in (by_updates, by_tokens, wrong):
        for _ in range(7):
            s.advance(committed_tokens=13)
    assert by_updates.clock_value == 7 and by_tokens.clock_value == 91
    assert by_updates.lr() == pytest.approx(closed_form(family, 7), rel=1e-12)
    assert by_tokens.lr() == pytest.approx(closed_form(family, 91), rel=1e-12)
    assert wrong.lr() != pytest.approx(closed_form(family, 91), rel=1e-12)  # negative control


@settings(max_examples=60, deadline=None)
@given(
    family=st.sampled_from(FAMILIES),
    warmup=st.integers(0, 50),
    horizon=st.integers(1, 500),
    ratio=st.floats(0.0, 1.0),
    c=st.integers(0, 2000),
)
def test_lr_is_positive_and_never_above_peak_u5(family, warmup, horizon, ratio, c):
    lr = schedule(family, warmup=warmup, horizon=horizon, min_lr_ratio=ratio).lr_at(c)
    assert math.isfinite(lr) and lr <= 1.0 + 1e-12
    assert lr > 0.0 or (ratio == 0.0 and family in ("cosine", "wsd"))


@settings(max_examples=40, deadline=None)
@given(
    family=st.sampled_from(["cosine", "wsd"]),
    warmup=st.integers(0, 30),
    horizon=st.integers(31, 400),
)
def test_decay_is_monotone_after_warmup_u5(family, warmup, horizon):
    s = schedule(family, warmup=warmup, horizon=horizon)
    values = [s.lr_at(c) for c in range(warmup, horizon + 5)]
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(0.1)


def test_state_round_trip_u5_s2():
    a = schedule("cosine", clock="tokens")
    for tokens in (5, 8, 13):
        a.advance(tokens)
    b = schedule("cosine", clock="tokens")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"updates": 3, "tokens": 26}
    assert b.lr() == pytest.approx(closed_form("cosine", 26), rel=1e-12)
    # negative control: a schedule that was not loaded is still at clock 0
    assert schedule("cosine", clock="tokens").lr() != pytest.approx(closed_form("cosine", 26))


def test_horizon_defaults_u5():
    cfg = UpdateConfig(schedule="cosine", clock="updates", decay_steps=0)
    assert build_schedule(cfg, total_windows=77).horizon == 77
    tokens_cfg = UpdateConfig(schedule="cosine", clock="tokens", decay_steps=1000)
    # the token horizon is the declared one; a slot estimate is never used
    assert build_schedule(tokens_cfg, 10).horizon == 1000


@pytest.mark.parametrize("family", ["cosine", "wsd"])
def test_token_clock_without_token_horizon_is_refused_at_config_time_u5(family):
    """The run's supervised-token count is unknown in advance: no silent estimate."""
    with pytest.raises(ConfigError, match=r"update\.decay_steps.*supervised tokens"):
        UpdateConfig(schedule=family, clock="tokens", decay_steps=0)
    with pytest.raises(ConfigError, match=r"update\.clock = 'tokens'"):
        load_config(overrides=["update.clock=tokens"])  # the default family is cosine


@pytest.mark.parametrize("family", ["constant", "noam", "inverse_sqrt"])
def test_families_without_a_horizon_need_none_on_the_token_clock_u5(family):
    s = build_schedule(
        UpdateConfig(lr=1.0, schedule=family, clock="tokens", warmup=4, decay_steps=0), 10
    )
    assert s.horizon is None
    assert s.lr_at(3) == pytest.approx(closed_form(family, 3, warmup=4), rel=1e-12)


def test_invalid_schedule_settings_name_the_key():
    with pytest.raises(ConfigError, match="update.decay_fraction"):
        UpdateConfig(decay_fraction=1.5)
    with pytest.raises(ConfigError, match="update.momentum"):
        UpdateConfig(momentum=1.0)


def test_token_clock_decay_ends_at_the_declared_supervised_tokens_u5():
    """Padded windows (4 supervised targets in 6 slots each) through the real engine:
    the lr follows the closed-form cosine in committed supervised tokens and reaches
    ``min_lr_ratio * lr`` once ``decay_steps`` tokens are committed. Negative control:
    the horizon the run used to estimate (windows x slots) is still decaying there."""
    from update_support import IGNORE_INDEX, make_batch, make_engine

    peak, floor, horizon, windows, slots = 1e-2, 0.1, 12, 5, 6
    engine = make_engine(schedule="cosine", clock="tokens", warmup=0, decay_steps=horizon,
                         lr=peak, min_lr_ratio=floor)
    x = IGNORE_INDEX

    def closed_form(tokens: int) -> float:
        progress = min(tokens, horizon) / horizon
        return peak * (floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2)

    used = [
        engine.run_window([make_batch([[1, 2, 3, 4, 5, 0]], [[2, 3, 4, 5, x, x]])], w).lr
        for w in range(windows)
    ]
    clock = [0, 4, 8, 12, 16]  # supervised tokens committed before each window
    assert used == pytest.approx([closed_form(c) for c in clock], rel=1e-12, abs=0)
    assert used[3] == pytest.approx(floor * peak, rel=1e-12) and used[4] == used[3]
    assert engine.schedule.tokens == 20 and engine.schedule.updates == windows

    slot_estimate = Schedule(UpdateConfig(schedule="cosine", clock="tokens", warmup=0,
                                          decay_steps=horizon, lr=peak, min_lr_ratio=floor),
                             windows * slots)
    assert slot_estimate.lr_at(12) != pytest.approx(closed_form(12), rel=1e-3)
