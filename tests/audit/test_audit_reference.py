"""The probes' own expectations (A1) checked against independent computations: the
smoothed loss against the explicit target distribution and PyTorch's criterion, the
closed-form AdamW step against ``torch.optim.AdamW``, and the reference SGD window
against ``F.cross_entropy`` + ``clip_grad_norm_`` + ``torch.optim.SGD``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from equivalence import FP32_UNIT, cross_entropy_bounds, gamma, smoothed_targets

from exactstep.audit import data
from exactstep.audit import reference as ref
from exactstep.audit.examples.nanogpt import NanoGPTLoop
from exactstep.audit.probes import RTOL
from exactstep.audit.protocol import ProbeSpec

SPEC = ProbeSpec()


def within(a: torch.Tensor, b: torch.Tensor, bound) -> bool:
    return bool(((a.double() - b.double()).abs() <= bound).all())


def row_bounds(z: torch.Tensor, gold: torch.Tensor, eps: float) -> torch.Tensor:
    """Twice the worst-case fp32 rounding bound of each row's smoothed loss from the
    same logits (``tests/equivalence.py``): two fp32 computations of it."""
    rows, _ = cross_entropy_bounds(z.double(), smoothed_targets(gold, z.shape[1], eps),
                                   torch.ones(len(gold)))
    return 2 * rows


def logits_and_gold(n: int = 6, v: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, v, generator=g), torch.randint(3, v, (n,), generator=g)


def test_harvard_smoothing_is_the_cross_entropy_of_its_target_distribution() -> None:
    z, gold = logits_and_gold()
    spec = replace(SPEC, label_smoothing=0.3, smoothing_convention="harvard")
    q = torch.full_like(z, 0.3 / (16 - 2))  # eps / (V - 2) off gold and PAD
    q[:, SPEC.pad_id] = 0.0
    q.scatter_(1, gold[:, None], 0.7)
    expected = -(q * z.log_softmax(-1)).sum(-1)
    assert within(ref.row_losses(z, gold, spec), expected, row_bounds(z, gold, 0.3))
    # negative control: the V - 1 denominator is a different loss
    q_wrong = q.clone().masked_fill(q == 0.3 / 14, 0.3 / 15)
    assert not within(ref.row_losses(z, gold, spec), -(q_wrong * z.log_softmax(-1)).sum(-1),
                      row_bounds(z, gold, 0.3))


def test_uniform_smoothing_is_pytorchs_label_smoothing() -> None:
    z, gold = logits_and_gold()
    spec = replace(SPEC, label_smoothing=0.3, smoothing_convention="uniform")
    expected = F.cross_entropy(z, gold, label_smoothing=0.3, reduction="none")
    assert within(ref.row_losses(z, gold, spec), expected, row_bounds(z, gold, 0.3))


def test_the_closed_form_adamw_step_is_torchs_first_step() -> None:
    g = torch.Generator().manual_seed(1)
    theta = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    grads = {n: torch.randn(t.shape, generator=g) * 1e-3 for n, t in theta.items()}
    spec = replace(SPEC, optimizer="adamw", lr=0.01, weight_decay=0.1, eps=1e-3)
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    opt = torch.optim.AdamW([{"params": [params["w"]], "weight_decay": 0.1},
                             {"params": [params["b"]], "weight_decay": 0.0}],
                            lr=0.01, betas=spec.betas, eps=1e-3)
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt.step()
    closed = ref.adamw_first_step(theta, grads, spec, {"w": True, "b": False})
    # the same gradients on both sides: each rounds the step's arithmetic (decay, two
    # moments and their bias corrections, root, + eps, quotient, subtraction) in fewer
    # than 16 roundings of quantities at most |theta| and lr: twice gamma(16) of them
    def bound(n: str) -> torch.Tensor:
        return 2 * gamma(16) * (theta[n].double().abs() + spec.lr_at(0))
    for n, p in params.items():
        assert within(closed[n], p.detach(), bound(n)), n
    # negative control: decaying b too is not what torch did
    wrong = ref.adamw_first_step(theta, grads, spec, {"w": True, "b": True})
    assert not within(wrong["b"], params["b"].detach(), bound("b"))


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_the_reference_window_is_plain_torch_training(clip: float) -> None:
    spec = replace(SPEC, clip=clip, accum=2)
    step = NanoGPTLoop()
    step.build(spec)
    g = torch.Generator().manual_seed(2)
    mbs = [data.single([data.text(g, 9, spec)], spec),
           data.single([data.text(g, 4, spec), data.text(g, 6, spec)], spec, length=9)]
    start = {name: p.detach().clone() for name, p in ref.named_parameters(step.module)}
    expected = ref.reference_sgd(step, mbs, spec)
    # the same window written with PyTorch's own pieces on the same model
    model = step.module
    losses, count = [], 0
    for mb in mbs:
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:].masked_fill(~mb.owned[:, 1:], -100)
        logits = model(x, mb.positions[:, :-1], mb.documents[:, :-1])
        losses.append(F.cross_entropy(logits.reshape(-1, 16), y.reshape(-1), reduction="sum"))
        count += int((y != -100).sum())
    (sum(losses) / count).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    torch.optim.SGD(model.parameters(), lr=spec.lr).step()
    # the probes' own contract for an fp32 update (``RTOL`` of the largest parameter
    # change), plus the rounding of each side's parameters (u |theta| each)
    scale = max(float((p.detach() - start[name]).abs().max())
                for name, p in ref.named_parameters(model))
    for name, p in ref.named_parameters(model):
        assert within(expected[name], p.detach(),
                      RTOL * scale + 2 * FP32_UNIT * p.detach().double().abs()), name
