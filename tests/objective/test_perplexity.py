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
    # batch 1: 3 tokens of NLL 1; batch 2: 1 token of NLL 3
    batches = [(3.0, 3), (3.0, 1)]
    right = perplexity(sum(s for s, _ in batches), sum(n for _, n in batches))
    assert right == pytest.approx(math.exp(1.5))
    # negative controls: averaging per-batch perplexities or per-batch losses differs
    per_batch_ppl = sum(math.exp(s / n) for s, n in batches) / 2
    per_batch_loss = math.exp(sum(s / n for s, n in batches) / 2)
    assert abs(per_batch_ppl - right) > 1e-3 and abs(per_batch_loss - right) > 1e-3


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
