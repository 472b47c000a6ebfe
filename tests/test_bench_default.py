"""The speed guard: the default run spends its time in user code, not in the kernel (L1, X1).

``exactstep bench default --quick`` runs the whole default command (10 windows) twice
in fresh processes: as shipped, and under the old 128 KiB mmap pin that page-faulted every
activation anew (the regression this guards against: system time about 60% of user
time, the run half as fast). The check is the ratio of system to user CPU seconds,
which the kernel counts per process, not a wall time: shared machines make wall
times noise. The old pin is the negative control: the same check must trip on it.
Both sides must end with the same loss (where a tensor lives changes no value).
At 10 windows on a quiet 2-core machine the ratio was 0.078 as shipped and 0.60 under
the old pin (start-up included), the same separation as at 100 windows (0.04, 0.67).
Under the suite's passive OpenMP waiting (``tests/conftest.py``: idle threads sleep in
the kernel) it was 0.113 as shipped against 0.68 under the old pin.
"""

from __future__ import annotations

import sys

import pytest

from exactstep.bench import default

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc, wait4")]

#: system time above this share of user time fails the default run
MAX_SYSTEM_SHARE = 0.25


@pytest.fixture(scope="module")
def figures() -> dict:
    return default.run(quick=True)


def test_the_default_run_spends_little_time_in_the_kernel(figures):
    assert figures["default_system_user_ratio"] <= MAX_SYSTEM_SHARE, figures


def test_the_old_pin_trips_the_same_check(figures):
    """Negative control: the check can fail, on the configuration that made it needed."""
    assert figures["old_pin_system_user_ratio"] > MAX_SYSTEM_SHARE, figures


def test_every_figure_is_reported_and_both_sides_agree(figures):
    for side in ("default", "old_pin"):
        for key in ("windows_per_s", "tokens_per_s", "user_s", "system_s", "peak_rss_mib",
                    "wall_s", "threads"):
            assert figures[f"{side}_{key}"] > 0, key
    assert figures["steps"] == default.QUICK["steps"]
    assert figures["same_loss"] is True  # the allocator changes no value (S5)
