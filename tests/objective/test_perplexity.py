"""Perplexity from globally reduced sums, N/A with a cause (L5)."""

from __future__ import annotations

import math

import pytest
import torch

from exactstep.errors import ObjectiveError
from exactstep.objective import (
    NotAvailable,
    ObjectiveConfig,
    logits_row_losses,
    mean_loss,
    perplexity,
)


def test_equal_logits_have_perplexity_v():
    logits = torch.zeros(6, 4)  # four equal logits per row: NLL ln 4 each
    _, nll = logits_row_losses(
        logits, torch.tensor([0, 1, 2, 3, 0, 1]), ObjectiveConfig(), pad_id=None
    )
    assert perplexity(float(nll.sum()), 6) == pytest.approx(4.0, rel=1e-6)


def test_global_sums_not_an_average_of_batch_perplexities():
    """Hand-worked: batch 1 has 3 tokens of NLL 1, batch 2 one token of NLL 3, so the
    global mean NLL is 6 / 4 = 1.5 and the perplexity e^1.5. The same check run on the
    per-batch aggregations (built from the same two functions) fails."""
    batches = [(3.0, 3), (3.0, 1)]
    expected = math.exp(1.5)
    right = perplexity(sum(s for s, _ in batches), sum(n for _, n in batches))
    assert right == pytest.approx(expected, rel=1e-12)
    per_batch_ppl = sum(perplexity(s, n) for s, n in batches) / 2  # (e^1 + e^3) / 2
    per_batch_loss = math.exp(sum(mean_loss(s, n) for s, n in batches) / 2)  # e^2
    assert per_batch_ppl != pytest.approx(expected, rel=1e-6)
    assert per_batch_loss != pytest.approx(expected, rel=1e-6)


def test_not_available_causes():
    assert perplexity(0.0, 0) == NotAvailable("NO_TOKENS")
    assert perplexity(1e6, 10) == NotAvailable("OVERFLOW")
    assert perplexity(float("inf"), 3) == NotAvailable("OVERFLOW")
    assert perplexity(float("nan"), 3) == NotAvailable("NON_FINITE")
    assert str(NotAvailable("NO_TOKENS")) == "N/A (NO_TOKENS)"
    assert mean_loss(5.0, 0) == NotAvailable("NO_TOKENS") and mean_loss(6.0, 4) == 1.5
    with pytest.raises(ObjectiveError):
        perplexity(1.0, -1)


def test_largest_representable_mean_still_has_a_value():
    value = perplexity(700.0, 1)
    assert isinstance(value, float) and value == pytest.approx(math.exp(700.0))
