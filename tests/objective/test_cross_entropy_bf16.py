"""L1 in bf16: the head product is returned in fp32, so the log-sum-exp sees unrounded
logits (issue 16 item 8).

Under bf16 autocast the head matmul takes bf16-rounded operands. The reference is the
exact cross entropy (float64) of those rounded operands: what an fp32-output product
approximates to fp32 rounding. Rounding the logits to bf16 before the log-sum-exp
(what a bf16-output matmul does) is the negative control: it lands orders of
magnitude further from the reference. A CUDA test checks the ``out_dtype`` kernel
against the same product formed in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import (
    cross_entropy_bounds,
    linear_cross_entropy_bounds,
    matmul_bound,
    smoothed_targets,
)

from exactstep.objective import cross_entropy as ce
from exactstep.objective.config import ObjectiveConfig

N, H, V = 96, 32, 200
CFG = ObjectiveConfig(chunk_rows=32)


def rounded_operands(hidden, weight) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.bfloat16().double(), weight.bfloat16().double()


def fp32_output_bounds(hidden, weight, labels) -> torch.Tensor:
    """Per row: how far an fp32-output product's cross entropy can be from the exact one
    of the bf16-rounded operands. bf16 x bf16 products are exact in fp32 (8 + 8
    significand bits), so the logits round only in their 32-term sums (``matmul_bound``),
    then the cross entropy rounds (``cross_entropy_bounds``); ~1e-3 here, where a
    bf16-rounded logit (steps of ~0.1 at tens) is off by ~1e-2 and more."""
    a, b = rounded_operands(hidden, weight)
    rows, _ = cross_entropy_bounds(a @ b.T, smoothed_targets(labels, V, 0.0), torch.ones(N),
                                   matmul_bound(a, b.T))
    return rows


def inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g) * 3.0  # logits of tens, where bf16 steps are ~0.1
    weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, labels


def exact_ce_of_rounded_operands(hidden, weight, labels) -> torch.Tensor:
    logits = hidden.bfloat16().double() @ weight.bfloat16().double().T  # [N, V] exact
    return F.cross_entropy(logits, labels, reduction="none")


def bf16_row_losses(hidden, weight, labels) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = ce.fused_row_losses(hidden, weight, labels, CFG, pad_id=None)
    assert loss.dtype == torch.float32
    return loss.double()


def bf16_output_head_mm(a, b):
    """WRONG on purpose: the product rounded to bf16, then widened (the old behaviour)."""
    return torch.mm(a.bfloat16(), b.bfloat16()).to(ce.loss_dtype(a.dtype))


def test_bf16_losses_see_unrounded_logits():
    hidden, weight, labels = inputs()
    reference = exact_ce_of_rounded_operands(hidden, weight, labels)
    assert (hidden @ weight.T).abs().max() > 30  # logits where bf16 rounding is coarse
    error = (bf16_row_losses(hidden, weight, labels) - reference).abs()
    assert (error <= fp32_output_bounds(hidden, weight, labels)).all()


def test_negative_control_bf16_output_is_much_further_from_the_reference(monkeypatch):
    hidden, weight, labels = inputs()
    reference = exact_ce_of_rounded_operands(hidden, weight, labels)
    good = float((bf16_row_losses(hidden, weight, labels) - reference).abs().max())
    monkeypatch.setattr(ce, "head_mm", bf16_output_head_mm)
    bad = (bf16_row_losses(hidden, weight, labels) - reference).abs()
    assert not (bad <= fp32_output_bounds(hidden, weight, labels)).all()  # fails the check
    assert float(bad.max()) > 1e-2 and float(bad.max()) > 100 * good, (float(bad.max()), good)


def test_weighted_sum_in_bf16_matches_the_reference_too():
    hidden, weight, labels = inputs()
    coeff = torch.rand(N, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        numerator, _ = ce.fused_weighted_sum(hidden, weight, labels, coeff, CFG, pad_id=None)
    expected = (coeff.double() * exact_ce_of_rounded_operands(hidden, weight, labels)).sum()
    bound, _, _ = linear_cross_entropy_bounds(*rounded_operands(hidden, weight),
                                              smoothed_targets(labels, V, 0.0), coeff)
    assert abs(float(numerator) - float(expected)) <= bound


def test_fp32_products_are_unchanged_plain_matmuls():
    hidden, weight, labels = inputs()
    loss, _ = ce.fused_row_losses(hidden, weight, labels, CFG, pad_id=None)
    h, w = hidden.double(), weight.double()  # both sides round: twice each row's bound
    rows, _ = cross_entropy_bounds(h @ w.T, smoothed_targets(labels, V, 0.0), torch.ones(N),
                                   matmul_bound(h, w.T))
    want = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    assert ((loss.double() - want.double()).abs() <= 2 * rows).all()
    a, b = hidden[:4], weight.T
    assert torch.equal(ce.head_mm(ce.mm_operand(a, torch.float32), b), torch.mm(a, b))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_out_dtype_product_equals_the_fp32_product_of_rounded_operands():
    hidden, weight, _ = (t.cuda() for t in inputs())
    a = ce.mm_operand(hidden, torch.bfloat16)
    b = ce.mm_operand(weight, torch.bfloat16).T
    assert a.dtype == torch.bfloat16  # on CUDA the operands stay bf16 ...
    out = ce.head_mm(a, b)
    assert out.dtype == torch.float32  # ... and the product comes back in fp32
    exact = a.double() @ b.double()  # exact products, fp32 sums of 32: gamma(32) |a| @ |b|
    assert ((out.double() - exact).abs() <= matmul_bound(a, b).to(exact.device)).all()
