"""Q4's split probe on every ``loss_type`` of ``trl``'s ``GRPOTrainer``, asserted as
measured (AUDIT.md, trl 1.16.0).

The probe checks the contract itself: each scored token's coefficient times the
window's token count is its sequence's advantage, the same when the window's lengths
are swapped, and the same coefficients under 1x8, 2x4 and 4x2 micro-batches. A
per-sequence token mean (``grpo``, ``sapo``) weighs a token as its sequence's
length^-1: a 1-token completion's token 6x a 6-token one's, and the FAIL's fix line
says so; ``bnpo`` normalises each micro-batch by its own tokens, so only its splits
move; ``dapo`` (the default), ``dr_grpo`` (a constant), ``cispo``, ``vespo`` (token
sums over the generation batch's tokens) and ``luspo`` (sequence sums over the count
of sequences) pass. A release that changes a verdict fails here: re-measure and
update AUDIT.md. The positive and negative controls of the probe itself (a correct
RLOO loop, a planted per-sequence mean, exactstep's ``sequence_mean``) are in
``test_policy_probes``.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from exactstep.audit.policy_probes import POLICY_PROBES  # noqa: E402
from exactstep.audit.probes import FAIL, PASS, run_probe  # noqa: E402
from exactstep.audit.trl_grpo import make  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
SPLIT = next(p for p in POLICY_PROBES if p.name == "policy_split")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def figures(observed: str) -> tuple[float, float, list[float]]:
    """(length exponent, 1-token over 6-token weight, the splits' deviations)."""
    found = re.search(r"length\^([+-][0-9.]+) \(a 1-token completion's token ([0-9.]+)x",
                      observed)
    splits = [float(v) for v in re.findall(r"\dx\d: deviation ([0-9.e+-]+)", observed)]
    return float(found.group(1)), float(found.group(2)), splits


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "cispo", "vespo", "luspo"])
def test_one_objective_loss_types_pass(loss_type):
    result = run_probe(SPLIT, make(loss_type))
    assert result.status == PASS, result.observed
    exponent, ratio, splits = figures(result.observed)
    assert (exponent, ratio) == pytest.approx((0.0, 1.0), abs=1e-3)
    assert len(splits) == 2


@pytest.mark.parametrize("loss_type", ["grpo", "sapo"])
def test_per_sequence_means_fail_with_their_length_weight(loss_type):
    """Each sequence's token mean, then the mean over sequences: invariant under every
    split (trl's micro-batches hold equal numbers of sequences), yet a token's weight
    is 1 / its sequence's length."""
    result = run_probe(SPLIT, make(loss_type))
    assert result.status == FAIL
    exponent, ratio, splits = figures(result.observed)
    assert (exponent, ratio) == pytest.approx((-1.0, 6.0), abs=1e-2)
    assert max(splits) < 1e-4
    assert result.fix.startswith("a token's weight goes as its sequence's length^-1.00 "
                                 "(a 1-token completion's token counts 6.0x a 6-token "
                                 "one's): the loss normalises each sequence by its own "
                                 "length")


def test_bnpo_fails_on_its_splits_only():
    result = run_probe(SPLIT, make("bnpo"))
    assert result.status == FAIL
    exponent, ratio, splits = figures(result.observed)
    assert (exponent, ratio) == pytest.approx((0.0, 1.0), abs=1e-3)
    assert splits == pytest.approx([0.20, 0.50], abs=5e-3)
    assert result.fix.startswith("normalise once per window")
