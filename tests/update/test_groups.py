"""Parameter groups, the optimizer and weight-decay conventions (U6)."""

from __future__ import annotations

import pytest
import torch
from equivalence import gamma
from torch import nn
from update_support import TinyLM, make_batch, make_engine, random_batch

from exactstep.errors import ConfigError
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.update.config import UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import (
    build_optimizer,
    paper_to_torch_weight_decay,
    resolve_groups,
    torch_to_paper_weight_decay,
)


class TiedByAssignment(nn.Module):
    """Embedding and head share one Parameter under two names (the common tie)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.norm = nn.LayerNorm(4)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    @property
    def head_weight(self):
        return self.head.weight

    def forward(self, batch):
        return torch.tanh(self.mix(self.norm(self.embed(batch.input_ids))))


def naive_groups(model: nn.Module) -> list[str]:
    """WRONG (U6): walks every name, so a tied tensor is listed twice."""
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


def each_tensor_once(names: list[str], model: nn.Module) -> bool:
    unique = {id(p) for p in model.parameters()}
    return len(names) == len(unique)


def test_tied_weight_appears_once_in_groups_u6():
    model = TiedByAssignment()
    groups = resolve_groups(model, UpdateConfig())
    names = [row["name"] for row in groups.table]
    assert each_tensor_once(names, model)
    assert not each_tensor_once(naive_groups(model), model)  # negative control
    assert len({id(p) for p in groups.parameters}) == len(groups.parameters)
    embed_row = next(row for row in groups.table if row["name"] == "embed.weight")
    assert embed_row["aliases"] == ["head.weight"]
    assert groups.numel == sum(p.numel() for p in model.parameters())


def test_tied_weight_counted_once_in_clip_norm_u6_u3():
    """The engine's pre-clip norm is over unique tensors; counting the tie twice differs."""
    model = TiedByAssignment()
    engine = make_engine(model, clip=1.0)
    batch = random_batch(torch.Generator().manual_seed(0), 2, 5)
    batch = make_batch(batch.input_ids.clamp_max(6).tolist(), batch.labels.clamp_max(6).tolist())
    # reference gradient of the window objective, per unique tensor
    from update_support import token_mean_plan, token_mean_terms

    plan = token_mean_plan([batch], None)
    num, _ = token_mean_terms(
        model(batch), model.head_weight, batch.labels, plan.coefficients[0], None, pad_id=0
    )
    unique = list(model.parameters())
    grads = torch.autograd.grad(num / plan.denominator, unique)
    once = float(torch.stack([g.norm() for g in grads]).norm())
    by_name = dict(model.named_parameters(remove_duplicate=False))
    grad_of = {id(p): g for p, g in zip(unique, grads, strict=True)}
    twice = float(torch.stack([grad_of[id(p)].norm() for p in by_name.values()]).norm())
    d = engine.run_window([batch], 0)
    assert d.grad_norm == pytest.approx(once, rel=1e-5)
    assert d.grad_norm != pytest.approx(twice, rel=1e-5)  # negative control


def test_decay_rule_u6():
    model = TiedByAssignment()
    table = {row["name"]: row["group"] for row in resolve_groups(model, UpdateConfig()).table}
    assert table == {
        "embed.weight": "no_decay",
        "norm.weight": "no_decay",
        "norm.bias": "no_decay",
        "mix.weight": "decay",
        "mix.bias": "no_decay",
    }
    with_embed = resolve_groups(model, UpdateConfig(decay_embeddings=True))
    assert {r["name"]: r["group"] for r in with_embed.table}["embed.weight"] == "decay"
    decays = {g["name"]: g["weight_decay"] for g in with_embed.param_groups}
    assert decays == {"decay": 0.1, "no_decay": 0.0}


def test_every_decoder_parameter_in_exactly_one_group_u6():
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32), 11, seed=0)
    groups = resolve_groups(model, UpdateConfig())
    ids = [id(p) for g in groups.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert len(set(ids)) == len(ids)
    for g in groups.param_groups:
        for p in g["params"]:
            assert (p.ndim >= 2 and p is not model.embed.weight) == (g["name"] == "decay")


def test_digest_pins_the_resolved_groups_u6_s1():
    model = TiedByAssignment()
    a = resolve_groups(model, UpdateConfig()).digest
    assert a == resolve_groups(TiedByAssignment(), UpdateConfig()).digest  # values don't matter
    assert a != resolve_groups(model, UpdateConfig(decay_embeddings=True)).digest
    assert a != resolve_groups(model, UpdateConfig(weight_decay=0.01)).digest
    assert a != resolve_groups(TinyLM(tied=False), UpdateConfig()).digest
    assert len(a) == 64


def test_frozen_parameters_are_left_out_u6():
    model = TiedByAssignment()
    model.norm.weight.requires_grad_(False)
    names = [row["name"] for row in resolve_groups(model, UpdateConfig()).table]
    assert "norm.weight" not in names and "norm.bias" in names


def test_model_without_trainable_parameters_is_a_config_error():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameter"):
        resolve_groups(model, UpdateConfig())


def test_weight_decay_conversion_worked_numbers_u6():
    """Reference worked numbers: lr 3e-4, PyTorch wd 0.1 -> paper 3e-5, and back."""
    assert torch_to_paper_weight_decay(0.1, 3e-4) == pytest.approx(3e-5, rel=1e-12)
    assert paper_to_torch_weight_decay(3e-5, 3e-4) == pytest.approx(0.1, rel=1e-12)
    with pytest.raises(ConfigError):
        paper_to_torch_weight_decay(3e-5, 0.0)


def test_pytorch_adamw_convention_decays_by_lr_times_wd_u6():
    """With a zero gradient, one AdamW step multiplies a decayed weight by 1 - lr*wd."""
    model = nn.Linear(3, 2, bias=False)
    cfg = UpdateConfig(lr=3e-4, weight_decay=0.1)
    optimizer, _ = build_optimizer(model, cfg)
    before = model.weight.detach().clone()
    model.weight.grad = torch.zeros_like(model.weight)
    optimizer.step()
    # PyTorch's convention: the weight shrinks by lr * wd = 3e-4 * 0.1 = 3e-5 (hand-worked);
    # each side rounds the factor and the product (and the zero step adds nothing):
    # within twice gamma(2) |w| of each other
    bound = 2 * gamma(2) * before.double().abs()
    assert ((model.weight.detach().double() - before * (1 - 3e-5)).abs() <= bound).all()
    # negative control: the paper's number used as PyTorch's would barely decay
    assert not ((model.weight.detach().double() - before * (1 - 0.1)).abs() <= bound).all()


def moves_each_param_by_lr(engine, lr: float) -> bool:
    """First AdamW step: every entry with a nonzero gradient moves by lr (|g| >> eps)."""
    batch = random_batch(torch.Generator().manual_seed(3), 3, 6)
    before = [p.detach().clone() for p in engine.parameters]
    assert engine.run_window([batch], 0).outcome is Outcome.COMMITTED
    moved_any = False
    for p, b in zip(engine.parameters, before, strict=True):
        step = (p.detach() - b).abs()
        nonzero = step > 0
        moved_any |= bool(nonzero.any())
        # |step| = lr |g| / (|g| + eps) (no decay here): within 1e-3 of lr when |g| >=
        # 1e3 eps = 1e-5, far below these gradients; fp32 rounds it by gamma(16) << 1e-3
        if not torch.allclose(step[nonzero], torch.full_like(step[nonzero], lr), rtol=1e-3):
            return False
    return moved_any


def test_first_adamw_step_moves_by_lr_u6():
    assert moves_each_param_by_lr(make_engine(lr=1e-2, clip=1.0), 1e-2)


def test_sgd_first_step_is_caught_u6():
    engine = make_engine(lr=1e-2, optimizer="sgd", momentum=0.0)
    assert not moves_each_param_by_lr(engine, 1e-2)


def test_sgd_with_momentum_builds_u6():
    optimizer, _ = build_optimizer(TinyLM(), UpdateConfig(optimizer="sgd", momentum=0.5))
    assert isinstance(optimizer, torch.optim.SGD)
    assert all(g["momentum"] == 0.5 for g in optimizer.param_groups)


def test_adafactor_uses_the_groups_and_commits_u6():
    engine = make_engine(optimizer="adafactor", lr=1e-2, weight_decay=0.1)
    assert isinstance(engine.optimizer, torch.optim.Adafactor)
    decays = {g["name"]: g["weight_decay"] for g in engine.optimizer.param_groups}
    assert decays == {"decay": 0.1, "no_decay": 0.0}
    before = [p.detach().clone() for p in engine.parameters]
    d = engine.run_window([random_batch(torch.Generator().manual_seed(5), 2, 5)], 0)
    assert d.outcome is Outcome.COMMITTED
    assert any(not torch.equal(p, b) for p, b in zip(engine.parameters, before, strict=True))
