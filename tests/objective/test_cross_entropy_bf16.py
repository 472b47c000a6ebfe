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

from exactstep.objective import cross_entropy as ce
from exactstep.objective.config import ObjectiveConfig

N, H, V = 96, 32, 200
CFG = ObjectiveConfig(chunk_rows=32)
FP32_OUTPUT_TOL = 1e-4  # fp32 sums of 32 products of logits up to ~60: a few 1e-6 observed


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
    error = float((bf16_row_losses(hidden, weight, labels) - reference).abs().max())
    assert error <= FP32_OUTPUT_TOL


def test_negative_control_bf16_output_is_much_further_from_the_reference(monkeypatch):
    hidden, weight, labels = inputs()
    reference = exact_ce_of_rounded_operands(hidden, weight, labels)
    good = float((bf16_row_losses(hidden, weight, labels) - reference).abs().max())
    monkeypatch.setattr(ce, "head_mm", bf16_output_head_mm)
    bad = float((bf16_row_losses(hidden, weight, labels) - reference).abs().max())
    assert bad > 1e-2 and bad > 100 * good, (bad, good)


def test_weighted_sum_in_bf16_matches_the_reference_too():
    hidden, weight, labels = inputs()
    coeff = torch.rand(N, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        numerator, _ = ce.fused_weighted_sum(hidden, weight, labels, coeff, CFG, pad_id=None)
    expected = (coeff.double() * exact_ce_of_rounded_operands(hidden, weight, labels)).sum()
    assert abs(float(numerator) - float(expected)) <= FP32_OUTPUT_TOL * N


def test_fp32_products_are_unchanged_plain_matmuls():
    hidden, weight, labels = inputs()
    loss, _ = ce.fused_row_losses(hidden, weight, labels, CFG, pad_id=None)
    torch.testing.assert_close(loss, F.cross_entropy(hidden @ weight.T, labels, reduction="none"),
                               rtol=1e-5, atol=1e-5)
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
    exact = a.double() @ b.double()
    assert float((out.double() - exact).abs().max()) <= FP32_OUTPUT_TOL
