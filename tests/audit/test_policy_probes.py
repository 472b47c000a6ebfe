"""The policy probes (Q3, Q4) against loops whose answers are known.

The correct RLOO loop (``audit.examples.rloo``) and exactstep's own policy family
(``audit.engine_policy``) must pass; each planted bug must fail exactly the probe
that looks for it, with the figure the bug predicts: a self-inclusive group mean
scales the expected update by (K-1)/K, dividing the window again by the accumulation
steps scales the coefficients by 1/steps, a per-sequence token mean weighs a token as
its sequence's length^-1 (a 1-token completion's token 6x a 6-token one's). ``expected_scale`` is checked against an
enumeration of every binary reward pattern of a group.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from exactstep.audit.engine_policy import make as engine_policy
from exactstep.audit.examples.rloo import make_variant
from exactstep.audit.policy_probes import (
    POLICY_PROBES,
    K,
    baseline_window,
    coefficients,
    contract_coefficients,
    expected_scale,
    leave_one_out,
    length_weights,
    split_window,
)
from exactstep.audit.probes import FAIL, NA, PASS, run_probe

PROBES = {p.name: p for p in POLICY_PROBES}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the audit's own setting (run_audit); recorded per test
    yield
    torch.set_num_threads(threads)


def status(step, name: str):
    return run_probe(PROBES[name], step)


def test_leave_one_out_by_hand():
    assert leave_one_out([1.0, 0.0, 0.0, 0.0]) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    window = baseline_window()
    assert window.samples == 20 and window.tokens == 40
    # group 2 (two rewarded of four): rewarded 1 - 1/3, unrewarded 0 - 2/3, over D = 40
    got = contract_coefficients(window)[8:12]
    assert got == pytest.approx([(2 / 3) / 40] * 2 + [(-2 / 3) / 40] * 2)


def enumerated_scale(advantage, p: float) -> float:
    """E[a_1 | r_1 = 1] - E[a_1 | r_1 = 0] by enumerating all 2^K reward patterns."""
    given = {1: 0.0, 0: 0.0}
    for pattern in itertools.product((0, 1), repeat=K):
        prob = math.prod(p if r else 1 - p for r in pattern[1:])  # the others
        given[pattern[0]] += prob * advantage([float(r) for r in pattern])[0]
    return given[1] - given[0]


def group_normalized(rewards):
    mean = sum(rewards) / len(rewards)
    spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (spread + 1e-4) for r in rewards]


@pytest.mark.parametrize("advantage", [leave_one_out, group_normalized,
                                       lambda rs: [r - sum(rs) / len(rs) for r in rs]])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_expected_scale_against_enumeration(advantage, p):
    rewarded = [advantage([1.0] + [1.0] * m + [0.0] * (K - 1 - m))[0] for m in range(K)]
    unrewarded = [advantage([0.0] + [1.0] * m + [0.0] * (K - 1 - m))[0] for m in range(K)]
    assert expected_scale(rewarded, unrewarded, p) == pytest.approx(
        enumerated_scale(advantage, p), rel=1e-12)


def test_correct_loop_passes_every_probe():
    step = make_variant("correct")
    for name in PROBES:
        assert status(step, name).status == PASS, name


def test_correct_loop_coefficients_are_the_contracts():
    """The recovered coefficients themselves, against leave-one-out over the window's
    tokens computed by hand (not by the loop)."""
    step = make_variant("correct")
    window = split_window()
    got = coefficients(step, window, window.samples)
    assert got == pytest.approx(contract_coefficients(window), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("variant,failing", [
    ("per_microbatch", {"policy_split", "policy_ranks"}),
    ("divided_twice", {"policy_split"}),
    ("group_mean", {"policy_baseline"}),
    ("group_normalized", {"policy_baseline"}),
    ("rank_mean", {"policy_ranks"}),
    ("per_sequence", {"policy_split"}),
])
def test_planted_bug_fails_its_probe(variant, failing):
    step = make_variant(variant)
    got = {name: status(step, name).status for name in PROBES}
    assert {n for n, s in got.items() if s == FAIL} == failing, got
    assert all(s == PASS for n, s in got.items() if n not in failing), got


def scales(observed: str) -> list[float]:
    return [float(v) for v in re.findall(r"scale ([0-9.]+)", observed)]


def test_divided_twice_scales_by_the_steps():
    result = status(make_variant("divided_twice"), "policy_split")
    assert scales(result.observed) == pytest.approx([1 / 2, 1 / 4], abs=1e-3)


def test_self_inclusive_mean_is_k_minus_one_over_k():
    result = status(make_variant("group_mean"), "policy_baseline")
    kappas = re.search(r": ([0-9./]+);", result.observed).group(1).split("/")
    assert [float(k) for k in kappas] == pytest.approx([(K - 1) / K] * 5, abs=1e-3)


def test_engine_passes_and_its_named_estimators_fail():
    """exactstep's own family: leave-one-out passes; ``group_mean_with_self`` (offered
    under its own name, Q3) fails the baseline probe at (K-1)/K."""
    step = engine_policy()
    results = {name: status(step, name) for name in PROBES}
    assert {n: r.status for n, r in results.items()} == dict.fromkeys(PROBES, PASS)
    assert "4x2: not run" in results["policy_split"].observed  # a group is one micro-batch
    biased = status(engine_policy("group_mean_with_self"), "policy_baseline")
    assert biased.status == FAIL and "0.750/0.750/0.750/0.750/0.750" in biased.observed


def length_figures(observed: str) -> tuple[float, float]:
    found = re.search(r"length\^([+-][0-9.]+) \(a 1-token completion's token ([0-9.]+)x "
                      r"a 6-token one's\)", observed)
    return float(found.group(1)), float(found.group(2))


def test_length_weights_by_hand():
    """``a`` proportional to 1 / length: exponent -1, and the 1-token sample's weight
    over its 6-token twin's is 6; the same ``a`` on every length: exponent 0."""
    lengths, twin = [1, 5, 2, 6], [6, 2, 5, 1]
    adv = [0.5, -0.25, 0.125, -1.0]
    exponent, ratio, short, long_ = length_weights(
        [a / n for a, n in zip(adv, lengths, strict=True)],
        [a / n for a, n in zip(adv, twin, strict=True)], lengths, twin)
    assert (exponent, short, long_) == (-1.0, 1, 6) and ratio == pytest.approx(6.0)
    assert length_weights(adv, adv, lengths, twin) == (0.0, 1.0, 1, 6)


def test_a_per_sequence_mean_fails_the_split_probe_with_its_length_weight():
    """Q4's contract itself: the planted per-sequence token mean passes every split
    (its micro-batches always hold whole sequences) but not c x D = the advantage;
    the fix line says why."""
    result = status(make_variant("per_sequence"), "policy_split")
    assert result.status == FAIL
    assert length_figures(result.observed) == pytest.approx((-1.0, 6.0), abs=1e-2)
    assert "2x4: deviation" in result.observed and "scale 1.000" in result.observed
    assert result.fix.startswith("a token's weight goes as its sequence's length^-1.00 "
                                 "(a 1-token completion's token counts 6.0x a 6-token")


def test_one_objective_has_no_length_weight():
    result = status(make_variant("correct"), "policy_split")
    assert length_figures(result.observed) == pytest.approx((0.0, 1.0), abs=1e-3)


def test_engine_sequence_mean_fails_the_split_probe_as_declared():
    """exactstep's own ``normalizer = "sequence_mean"`` (declared 1 / length in the
    manifest) fails the contract; ``constant`` passes it."""
    seq = status(engine_policy("leave_one_out:sequence_mean"), "policy_split")
    assert seq.status == FAIL
    assert length_figures(seq.observed) == pytest.approx((-1.0, 6.0), abs=1e-2)
    assert status(engine_policy(":constant"), "policy_split").status == PASS


def test_ranks_not_applicable_without_them():
    class OneRank:
        ranks = 1

    assert run_probe(PROBES["policy_ranks"], OneRank()).status == NA
