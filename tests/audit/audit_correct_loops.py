"""Correct loops written another way than the examples (A2's negative controls).

Each reaches the declared update by a route the example loops do not take, the way
real training code often does; every probe must pass them (``test_audit_matrix``):

- ``FunctionalEmbedding``: the token and position tables are ``nn.Parameter``s read
  with ``F.embedding``, the head is ``F.linear`` on the token table (tied), and the
  loop calls ``model.forward`` directly (no module hooks on the top module);
- ``FusedAdamW``: ``torch.optim.AdamW(fused=True)`` / ``SGD(foreach=True)``;
- ``ManualLogSoftmaxGather``: the loss written as ``log_softmax`` + ``gather`` with
  its own mask and uniform smoothing, no ``F.cross_entropy``;
- ``LambdaLRPerCommittedUpdate``: the schedule is a ``LambdaLR`` stepped once per
  committed update (saved and loaded with the checkpoint);
- ``WholeWindowOneForward``: the window's microbatches padded to one length and
  concatenated into a single forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from exactstep.audit.examples.nanogpt import GPT, IGNORE, Block, NanoGPTLoop
from exactstep.audit.protocol import Microbatch, ProbeSpec


class FunctionalGPT(nn.Module):
    """nanoGPT with its tables as plain parameters: ``F.embedding`` in, ``F.linear`` on
    the same token table out."""

    def __init__(self, spec: ProbeSpec, block_size: int = 64) -> None:
        super().__init__()
        d = spec.d_model
        self.wte = nn.Parameter(torch.randn(spec.vocab_size, d) * 0.02)
        self.wpe = nn.Parameter(torch.randn(block_size, d) * 0.02)
        self.drop = nn.Dropout(spec.dropout)
        self.h = nn.ModuleList(Block(d, spec.n_heads, spec.dropout)
                               for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.embedding(idx, self.wte) + F.embedding(pos, self.wpe))
        mask = GPT.attention_mask(self, documents)
        for block in self.h:
            x = block(x, mask)
        return F.linear(self.ln_f(x), self.wte)


class FunctionalEmbedding(NanoGPTLoop):
    model_type = FunctionalGPT

    def build(self, spec: ProbeSpec) -> None:
        super().build(spec)
        if self.world == 1:
            self.model = self.module.forward  # called directly: no top-module hooks

    def configure_optimizer(self) -> torch.optim.Optimizer:
        tables = {"wte", "wpe"}
        named = list(self.module.named_parameters())
        decay = [p for n, p in named if p.dim() >= 2 and n not in tables]
        rest = [p for n, p in named if p.dim() < 2 or n in tables]
        groups = [{"params": decay, "weight_decay": self.spec.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        if self.spec.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.spec.lr)
        return torch.optim.AdamW(groups, lr=self.spec.lr, betas=self.spec.betas,
                                 eps=self.spec.eps)


class FusedAdamW(NanoGPTLoop):
    def configure_optimizer(self) -> torch.optim.Optimizer:
        groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay")}
                  for g in super().configure_optimizer().param_groups]
        if self.spec.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.spec.lr, foreach=True)
        return torch.optim.AdamW(groups, lr=self.spec.lr, betas=self.spec.betas,
                                 eps=self.spec.eps, fused=True)


class ManualLogSoftmaxGather(NanoGPTLoop):
    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
        keep = y != IGNORE
        gold = logp.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1)  # [B, T]
        eps = self.spec.label_smoothing
        per_token = -(1.0 - eps) * gold - eps * logp.mean(-1)  # uniform smoothing (L2)
        return torch.where(keep, per_token, torch.zeros_like(per_token)).sum()


class LambdaLRPerCommittedUpdate(NanoGPTLoop):
    def build(self, spec: ProbeSpec) -> None:
        super().build(spec)
        warmup = spec.warmup
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: 1.0 if warmup <= 0 else min(1.0, (k + 1) / warmup))

    def close_window(self, loss: float) -> float | None:
        norm = self.unscale_and_clip()
        if not (math.isfinite(loss) and torch.isfinite(norm)):
            self.scaler.update()
            self.zero_grad()
            return None
        self.step_optimizer()
        self.zero_grad()
        self.scheduler.step()  # once per committed update (U5)
        return loss

    def save(self, path: Path) -> None:
        super().save(path)
        torch.save(self.scheduler.state_dict(), Path(f"{path}.scheduler"))

    def load(self, path: Path) -> None:
        super().load(path)
        self.scheduler.load_state_dict(torch.load(Path(f"{path}.scheduler")))


class WholeWindowOneForward(NanoGPTLoop):
    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None
        width = max(x.shape[1] for x, *_ in batches)

        def cat(i: int, value: int) -> torch.Tensor:
            return torch.cat([F.pad(b[i], (0, width - b[i].shape[1]), value=value)
                              for b in batches])

        x, pos, docs, y = cat(0, self.spec.pad_id), cat(1, 0), cat(2, 0), cat(3, IGNORE)
        loss = self.loss_sum(self.model(x, pos, docs), y) * self.world / n_tokens
        self.scaler.scale(loss).backward()
        return self.close_window(loss.item())
