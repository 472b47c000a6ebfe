"""Tiny stand-ins and builders shared by the update tests.

``TinyLM`` returns hidden states and exposes ``head_weight`` like the built-in
decoder; ``token_mean_plan`` / ``token_mean_terms`` are a minimal token-mean
objective (L3) with the same signatures as the objective stage's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.types import NoObjective, NoObjectiveCause
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB = 11
HIDDEN = 8
PAD = 0


class TinyLM(nn.Module):
    """Embedding -> norm -> linear(+bias) -> hidden ``[B, T, H]``; optional tied head."""

    def __init__(self, *, tied: bool = True, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head = None if tied else nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, batch: Batch) -> torch.Tensor:
        x = self.embed(batch.input_ids)  # [B, T, H]
        return torch.tanh(self.proj(self.norm(x)))  # [B, T, H]


@dataclass(frozen=True)
class Plan:
    coefficients: list[torch.Tensor]
    denominator: float
    tokens: int


def token_mean_plan(batches: Sequence[Batch], cfg: ObjectiveConfig) -> Plan | NoObjective:
    coefficients = [(b.labels != IGNORE_INDEX).float() for b in batches]  # [B, T] each
    tokens = int(sum(int(c.sum()) for c in coefficients))
    if tokens == 0:
        return NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)
    return Plan(coefficients, float(tokens), tokens)


def token_mean_terms(hidden, head_weight, labels, coeff, cfg, *, pad_id):
    logits = (hidden @ head_weight.t()).float()  # [B, T, V]
    nll = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten().clamp_min(0), reduction="none"
    )  # [B*T]
    numerator = (nll * coeff.flatten()).sum()
    gold = (nll.detach() * (labels.flatten() != IGNORE_INDEX)).sum()
    return numerator, gold


def make_batch(rows: list[list[int]], labels: list[list[int]]) -> Batch:
    input_ids = torch.tensor(rows, dtype=torch.long)  # [B, T]
    label_t = torch.tensor(labels, dtype=torch.long)  # [B, T]
    b, t = input_ids.shape
    positions = torch.arange(t).expand(b, t).clone()
    segment_ids = torch.ones(b, t, dtype=torch.int32)
    segments = tuple((Segment(i, 0, 0, 0, t),) for i in range(b))
    return Batch(input_ids, label_t, positions, segment_ids, segments)


def random_batch(gen: torch.Generator, rows: int, length: int, supervised: float = 0.7) -> Batch:
    ids = torch.randint(1, VOCAB, (rows, length), generator=gen)
    labels = torch.randint(1, VOCAB, (rows, length), generator=gen)
    keep = torch.rand(rows, length, generator=gen) < supervised
    labels = torch.where(keep, labels, torch.full_like(labels, IGNORE_INDEX))
    return make_batch(ids.tolist(), labels.tolist())


def make_engine(
    model: nn.Module | None = None,
    *,
    precision: str = "fp32",
    init_scale: float = 65536.0,
    total_windows: int = 10,
    engine_cls: type[UpdateEngine] = UpdateEngine,
    **update_overrides,
) -> UpdateEngine:
    model = model if model is not None else TinyLM()
    settings = {"schedule": "constant", "warmup": 0, "clip": 0.0, "weight_decay": 0.0}
    settings.update(update_overrides)
    update_cfg = UpdateConfig(**settings)
    optimizer, _ = build_optimizer(model, update_cfg)
    return engine_cls(
        model,
        optimizer,
        build_schedule(update_cfg, total_windows),
        Precision(NumericsConfig(precision=precision, init_scale=init_scale), "cpu"),
        update_cfg,
        ObjectiveConfig(),
        device="cpu",
        pad_id=PAD,
        plan=token_mean_plan,
        terms=token_mean_terms,
    )


def snapshot(engine: UpdateEngine) -> dict:
    """Deep copy of everything a skip must leave bitwise unchanged (U4)."""
    opt_state = {
        id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for p, s in engine.optimizer.state.items()
    }
    return {
        "params": [p.detach().clone() for p in engine.parameters],
        "optimizer": opt_state,
        "schedule": dict(engine.schedule.state_dict()),
        "lr": engine.schedule.lr(),
    }


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"], strict=True):
        assert torch.equal(x, y)
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for key in a["optimizer"]:
        sa, sb = a["optimizer"][key], b["optimizer"][key]
        assert sa.keys() == sb.keys()
        for name in sa:
            if torch.is_tensor(sa[name]):
                assert torch.equal(sa[name], sb[name]), name
            else:
                assert sa[name] == sb[name], name
    assert a["schedule"] == b["schedule"]
    assert a["lr"] == b["lr"]
