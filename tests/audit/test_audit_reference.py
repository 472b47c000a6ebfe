"""The probes' own expectations (A1) checked against independent computations: the
smoothed loss against the explicit target distribution and PyTorch's criterion, the
closed-form AdamW step against ``torch.optim.AdamW``, and the reference SGD window
against ``F.cross_entropy`` + ``clip_grad_norm_`` + ``torch.optim.SGD``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from exactstep.audit import data
from exactstep.audit import reference as ref
from exactstep.audit.examples.nanogpt import NanoGPTLoop
from exactstep.audit.protocol import ProbeSpec

SPEC = ProbeSpec()


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
    torch.testing.assert_close(ref.row_losses(z, gold, spec), expected, rtol=1e-6, atol=1e-6)
    # negative control: the V - 1 denominator is a different loss
    q_wrong = q.clone().masked_fill(q == 0.3 / 14, 0.3 / 15)
    assert not torch.allclose(ref.row_losses(z, gold, spec),
                              -(q_wrong * z.log_softmax(-1)).sum(-1), atol=1e-4)


def test_uniform_smoothing_is_pytorchs_label_smoothing() -> None:
    z, gold = logits_and_gold()
    spec = replace(SPEC, label_smoothing=0.3, smoothing_convention="uniform")
    expected = F.cross_entropy(z, gold, label_smoothing=0.3, reduction="none")
    torch.testing.assert_close(ref.row_losses(z, gold, spec), expected, rtol=1e-6, atol=1e-6)


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
    for n, p in params.items():
        torch.testing.assert_close(closed[n], p.detach(), rtol=1e-6, atol=1e-8)
    # negative control: decaying b too is not what torch did
    wrong = ref.adamw_first_step(theta, grads, spec, {"w": True, "b": True})
    assert not torch.allclose(wrong["b"], params["b"].detach(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("clip", [0.0, 1e-3])
def test_the_reference_window_is_plain_torch_training(clip: float) -> None:
    spec = replace(SPEC, clip=clip, accum=2)
    step = NanoGPTLoop()
    step.build(spec)
    g = torch.Generator().manual_seed(2)
    mbs = [data.single([data.text(g, 9, spec)], spec),
           data.single([data.text(g, 4, spec), data.text(g, 6, spec)], spec, length=9)]
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
    for name, p in ref.named_parameters(model):
        torch.testing.assert_close(expected[name], p.detach(), rtol=1e-5, atol=1e-7)
