"""``exactstep bench rollout``'s HF sides measure the same work (Q1).

Each side (``sample_window``, HF ``generate``, ``sample_group`` per prompt, and on whole
rows) continues the same prompts ``K`` times for the same number of new tokens on the
same model; the side's own count of drawn tokens must be ``prompts x K x tokens``
(``generate`` reports the columns it appended: with a stop token it could end early,
the control). The peak resident set is counted from after the build.
"""

from __future__ import annotations

import pytest

from exactstep.bench import rollout

SPEC = {"model": rollout.HF_MODELS["small"], "lengths": [3, 9, 5], "samples": 2, "tokens": 6,
        "repeats": 1, "threads": 1}


@pytest.mark.parametrize("side", rollout.HF_SIDES)
def test_every_hf_side_draws_the_same_tokens_on_the_same_model(side):
    got = rollout.hf_side({**SPEC, "side": side})
    assert got["tokens"] == 3 * 2 * 6
    assert got["parameters"] == rollout.hf_side({**SPEC, "side": "window"})["parameters"]
    assert got["tokens_per_s"] > 0 and got["peak_rss_mib"] >= got["built_rss_mib"] * 0.5


def test_a_side_that_stops_early_is_refused(monkeypatch):
    """Control: a side whose rows meet stop tokens ends them early; it refuses to
    report a rate for other work than the other sides'."""
    spec = {**SPEC, "side": "window", "tokens": 20}
    assert rollout.hf_side(spec)["tokens"] == 3 * 2 * 20  # no stop token: full length
    monkeypatch.setattr(rollout, "NO_STOP", tuple(range(1, 259)))  # all ids but 0 stop
    with pytest.raises(AssertionError):
        rollout.hf_side(spec)


def test_the_cpu_is_named():
    assert rollout.cpu_model().endswith("cores") and "unknown" not in rollout.cpu_model()
