"""Allowed ranges of numeric configuration values, checked at the boundary (X2, X4).

Each section's ``__post_init__`` calls ``check(key, value, allowed)``; a value
outside its range (a non-finite float, an integer past 64 bits, a float32 value that
would round to 0 or infinity) is a ``ConfigError`` naming key, range and value.
Design and derivations: docs/design/run.md#rangespy (X2, X4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from exactstep.errors import ConfigError

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest positive normal float32


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; ``None`` leaves a side unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # said after the interval, e.g. "(a positive normal float32)"

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        if self.high is not None and not (
            value < self.high if self.high_open else value <= self.high
        ):
            return False
        return True

    def __str__(self) -> str:
        return self.interval() + (f" ({self.note})" if self.note else "")

    def interval(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{number(self.low)}, {number(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {number(self.high)}"
        return "a finite number"


def number(value: float) -> str:
    """A bound as the user would type it: ``1``, ``0.5``, ``2**63 - 1``, ``3.4e+38``."""
    if value == INT64_MAX:
        return "2**63 - 1"
    if value == INT64_MIN:
        return "-2**63"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.3g}"


def at_least(low: float) -> Range:
    return Range(low=low)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def between(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low=low, high=high, low_open=low_open, high_open=high_open)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT64 = between(INT64_MIN, INT64_MAX)
UNIT = between(0.0, 1.0)  # [0, 1]
POSITIVE_FLOAT32 = Range(low=FLOAT32_TINY, high=FLOAT32_MAX, note="a positive normal float32")


def check(key: str, value: float, allowed: Range) -> None:
    """Raise ``ConfigError`` naming ``key`` and ``allowed`` unless ``value`` lies in it.

    A non-finite float never lies in any range; its message says a finite number is
    needed.
    """
    if value in allowed:
        return
    finite = "" if not isinstance(value, float) or math.isfinite(value) else "a finite number "
    raise ConfigError(f"{key} must be {finite}{allowed}; got {value!r}")


def check_int(key: str, value: int) -> None:
    """Raise ``ConfigError`` unless ``value`` fits a signed 64-bit integer."""
    if value not in INT64:
        raise ConfigError(f"{key} must be an integer in [-2**63, 2**63 - 1]; got {value}")


def check_finite(key: str, value: float) -> None:
    """Raise ``ConfigError`` for NaN and the infinities (no key gives them a meaning)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number; got {value!r}")
