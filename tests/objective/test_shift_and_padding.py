"""The shift (R1) and padding invariance (L6) through plan + microbatch terms."""

from __future__ import annotations

import copy

import pytest
import torch
from equivalence import (
    FP32_UNIT,
    cross_entropy_bounds,
    smoothed_targets,
    spread_bound,
    sum_bound,
)
from objective_batches import X, make_batch

from exactstep.objective import ObjectiveConfig, logits_row_losses, microbatch_terms, plan_window
from exactstep.objective import reference as ref

V, H, PAD = 9, 5, 0


class TinyCausalModel(torch.nn.Module):
    """Hidden state of row i = tanh(linear(mean of embeddings of tokens 0..i))."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(V, H, generator=g))
        self.mix = torch.nn.Parameter(torch.randn(H, H, generator=g) / H**0.5)
        self.head = torch.nn.Parameter(torch.randn(V, H, generator=g))

    def hidden(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        x = self.embed[input_ids_BT]  # [B, T, H]
        counts = torch.arange(1, x.shape[1] + 1, dtype=x.dtype).view(1, -1, 1)
        return torch.tanh((x.cumsum(1) / counts) @ self.mix)  # [B, T, H], causal

    def logits(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.hidden(input_ids_BT) @ self.head.T  # [B, T, V]


def shifted(tokens: list[int]) -> list[int]:
    return tokens[1:] + [X]


def window_loss(model, rows: list[list[int]], labels: list[list[int]]):
    batch = make_batch(labels)
    batch = type(batch)(**{**batch.__dict__, "input_ids": torch.tensor(rows)})
    plan = plan_window([batch], ObjectiveConfig(chunk_rows=3))
    numerator, _ = microbatch_terms(
        model.hidden(batch.input_ids),
        model.head,
        batch.labels,
        plan.coefficients[0],
        ObjectiveConfig(chunk_rows=3),
        pad_id=PAD,
        rows_index=plan.row_indices[0],
    )
    return numerator / plan.denominator


def params_grad(model, loss):
    return torch.autograd.grad(loss, list(model.parameters()))


SEQS = [[3, 4, 5, 6, 7], [2, 8, 1]]


def padded(seqs, length):
    rows = [s + [PAD] * (length - len(s)) for s in seqs]
    labels = [shifted(s) + [X] * (length - len(s)) for s in seqs]
    return rows, labels


@pytest.mark.parametrize("extra", [1, 4])
def test_appending_padding_changes_neither_loss_nor_gradient(extra):
    """Within the fp32 spread of the unpadded window (``spread_bound``: its distance from
    the same window in float64): padding may change the kernels' shapes, not the value."""
    model = TinyCausalModel()
    base = window_loss(model, *padded(SEQS, 5))
    more = window_loss(model, *padded(SEQS, 5 + extra))
    exact_model = copy.deepcopy(model).double()
    exact = window_loss(exact_model, *padded(SEQS, 5))
    assert abs(base.item() - more.item()) <= spread_bound(base, exact)
    for a, b, e in zip(params_grad(model, base), params_grad(model, more),
                       params_grad(exact_model, exact), strict=True):
        assert float((a - b).abs().max()) <= spread_bound(a, e)


def test_padding_check_catches_a_loss_that_counts_padding_rows():
    """Negative control: dividing by all B*T rows (pad included) moves with padding."""

    def wrong_loss(length):
        rows, labels = padded(SEQS, length)
        y = torch.tensor(labels)
        logits = TinyCausalModel().logits(torch.tensor(rows))
        ce, _ = logits_row_losses(
            logits.reshape(-1, V), y.reshape(-1), ObjectiveConfig(), pad_id=PAD
        )
        return ce.sum() / y.numel()

    assert abs(wrong_loss(5).item() - wrong_loss(9).item()) > 1e-3


def reference_loss(logits_BTV: torch.Tensor, seqs) -> float:
    """The pure-Python oracle: it shifts raw tokens itself (R1)."""
    logits = logits_BTV.tolist()
    labels = [ref.next_token_labels(s) for s in seqs]
    return ref.masked_next_token_loss(logits, labels)[0]


@pytest.mark.parametrize(
    ("variant", "should_match"),
    [("shift once", True), ("no shift", False), ("double shift", False)],
)
def test_only_a_single_shift_agrees_with_the_reference(variant, should_match):
    seqs = [[3, 4, 5, 6, 7, 1], [2, 8, 1, 5, 5, 6]]
    model = TinyCausalModel()
    logits = model.logits(torch.tensor(seqs)).detach()  # [B, T, V]
    make_labels = {
        "shift once": shifted,
        "no shift": lambda s: list(s),
        "double shift": lambda s: s[2:] + [X, X],
    }[variant]
    labels = torch.tensor([make_labels(s) for s in seqs])
    ce, _ = logits_row_losses(
        logits.reshape(-1, V), labels.reshape(-1), ObjectiveConfig(), pad_id=None
    )
    ours = ce.sum() / (labels != X).sum()
    # the reference is exact on the same fp32 logits: our rows' worst-case rounding, the
    # sum of n of them (gamma(n)) and the division
    flat = labels.reshape(-1)
    n = int((flat != X).sum())
    rows, _ = cross_entropy_bounds(logits.reshape(-1, V).double(), smoothed_targets(flat, V, 0.0, X),
                                   (flat != X).double())
    bound = (float(rows.sum()) + sum_bound(ce.detach())) / n + FP32_UNIT * abs(ours.item())
    agrees = abs(ours.item() - reference_loss(logits, seqs)) <= bound
    assert agrees == should_match
