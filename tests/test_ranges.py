"""The range checks behind every numeric configuration key (X2, X4)."""

from __future__ import annotations

import math

import pytest

from exactstep.errors import ConfigError
from exactstep.ranges import (
    INT64,
    POSITIVE_FLOAT32,
    UNIT,
    Range,
    above,
    at_least,
    between,
    check,
    check_int,
)


@pytest.mark.parametrize(
    ("allowed", "text"),
    [
        (at_least(1), ">= 1"),
        (above(0), "> 0"),
        (UNIT, "in [0, 1]"),
        (between(0, 1, high_open=True), "in [0, 1)"),
        (between(0, 1, low_open=True, high_open=True), "in (0, 1)"),
        (between(0, 1e9, low_open=True), "in (0, 1000000000]"),
        (Range(high=5), "<= 5"),
        (INT64, "in [-2**63, 2**63 - 1]"),
        (POSITIVE_FLOAT32, "in [1.18e-38, 3.4e+38] (a positive normal float32)"),
        (Range(), "a finite number"),
    ],
)
def test_a_range_says_itself_as_the_user_would_type_it(allowed: Range, text: str) -> None:
    assert str(allowed) == text


@pytest.mark.parametrize("allowed", [Range(), at_least(0), Range(high=1), UNIT, INT64])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_no_range_holds_a_non_finite_value(allowed: Range, value: float) -> None:
    assert value not in allowed


def test_edges_are_open_or_closed_as_declared() -> None:
    half_open = between(0, 1, high_open=True)
    assert 0 in half_open and 0.999 in half_open and 1 not in half_open and -1e-300 not in half_open
    assert 0 not in above(0) and 5e-324 in above(0)
    assert 2**63 - 1 in INT64 and 2**63 not in INT64 and -(2**63) in INT64
    # the displayed float32 bounds are safe to type back: both lie inside the range
    assert 1.18e-38 in POSITIVE_FLOAT32 and 3.4e38 in POSITIVE_FLOAT32
    assert 1e-39 not in POSITIVE_FLOAT32 and 3.5e38 not in POSITIVE_FLOAT32


def test_check_names_the_key_the_range_and_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        check("update.beta1", 1.0, between(0, 1, high_open=True))
    assert str(info.value) == "update.beta1 must be in [0, 1); got 1.0"
    with pytest.raises(ConfigError) as info:
        check("update.weight_decay", math.nan, at_least(0))
    assert str(info.value) == "update.weight_decay must be a finite number >= 0; got nan"
    with pytest.raises(ConfigError) as info:
        check_int("train.steps", 2**64)
    assert str(info.value) == f"train.steps must be an integer in [-2**63, 2**63 - 1]; got {2**64}"
    check("update.beta1", 0.0, between(0, 1, high_open=True))  # in range: no error
