"""An Annotated-Transformer-style loop, correct, wrapped for ``exactstep audit`` (A1, A2).

Run it with ``exactstep audit --target python:exactstep.audit.examples.annotated:make``.
The pieces are the Annotated Transformer's ``run_epoch`` loop on a decoder-only model,
corrected where the historical code is only right for one batch per step (U1, L4, U4),
with packed documents kept apart (R3) and the loop's data position checkpointed (S2).
Design and derivations: docs/design/audit.md#auditexamplesannotatedpy (A1, A2).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from exactstep.audit.protocol import Microbatch, ProbeSpec, WindowCursor


def attention(query, key, value, mask=None, dropout=None):  # noqa: ANN001, ANN201
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value)


class MultiHeadedAttention(nn.Module):
    def __init__(self, h: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.d_k, self.h = d_model // h, h
        self.linears = nn.ModuleList(copy.deepcopy(nn.Linear(d_model, d_model))
                                     for _ in range(4))
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B = x.size(0)
        q, k, v = (lin(x).view(B, -1, self.h, self.d_k).transpose(1, 2)
                   for lin in self.linears[:3])
        y = attention(q, k, v, mask=mask.unsqueeze(1), dropout=self.dropout)
        return self.linears[-1](y.transpose(1, 2).contiguous().view(B, -1, self.h * self.d_k))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.self_attn = MultiHeadedAttention(spec.n_heads, d, spec.dropout)
        self.feed_forward = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(),
                                          nn.Dropout(spec.dropout), nn.Linear(4 * d, d))
        self.norms = nn.ModuleList([nn.LayerNorm(d), nn.LayerNorm(d)])
        self.dropout = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.norms[0](x), mask))
        return x + self.dropout(self.feed_forward(self.norms[1](x)))


class Generator(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(x), dim=-1)


class DecoderOnly(nn.Module):
    def __init__(self, spec: ProbeSpec) -> None:
        super().__init__()
        self.d_model = spec.d_model
        self.embed = nn.Embedding(spec.vocab_size, spec.d_model)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.n_layers))
        self.norm = nn.LayerNorm(spec.d_model)
        self.generator = Generator(spec.d_model, spec.vocab_size)
        self.drop = nn.Dropout(spec.dropout)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def positional(self, positions: torch.Tensor) -> torch.Tensor:
        """Sinusoidal encoding of each token's position in its document."""
        i = torch.arange(0, self.d_model, 2, dtype=torch.float32)
        angle = positions[..., None].float() * torch.exp(-math.log(10000.0) * i / self.d_model)
        return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # [B, T, d]

    def forward(self, tgt: torch.Tensor, positions: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tgt) * math.sqrt(self.d_model) + self.positional(positions))
        for layer in self.layers:
            x = layer(x, tgt_mask)
        return self.norm(x)  # [B, T, d]; generator(out) gives log-probabilities


def subsequent_mask(size: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, size, size), diagonal=1) == 0


class Batch:
    """``tgt`` (input), ``tgt_y`` (next tokens, PAD where not supervised), masks, ntokens."""

    def __init__(self, mb: Microbatch, pad: int) -> None:
        self.tgt = mb.tokens[:, :-1]
        self.positions = mb.positions[:, :-1]
        keep = mb.owned[:, 1:] & (mb.documents[:, 1:] == mb.documents[:, :-1])
        self.tgt_y = mb.tokens[:, 1:].masked_fill(~keep, pad)
        self.tgt_mask = self.make_std_mask(mb.documents[:, :-1])
        self.ntokens = int((self.tgt_y != pad).sum())

    @staticmethod
    def make_std_mask(documents: torch.Tensor) -> torch.Tensor:
        """Causal and within the token's document (padding is its own document 0)."""
        same = documents.unsqueeze(-1) == documents.unsqueeze(-2)
        return same & subsequent_mask(documents.size(-1))


class LabelSmoothing(nn.Module):
    def __init__(self, size: int, padding_idx: int, smoothing: float) -> None:
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="sum")
        self.padding_idx, self.size = padding_idx, size
        self.confidence, self.smoothing = 1.0 - smoothing, smoothing

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        true_dist = x.data.clone()
        true_dist.fill_(self.smoothing / (self.size - 2))
        true_dist.scatter_(1, target.data.unsqueeze(1), self.confidence)
        true_dist[:, self.padding_idx] = 0
        true_dist[target.data == self.padding_idx] = 0
        return self.criterion(x, true_dist.clone().detach())


class SimpleLossCompute:
    def __init__(self, generator: nn.Module, criterion: nn.Module) -> None:
        self.generator, self.criterion = generator, criterion

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
        x = self.generator(x)
        sloss = self.criterion(x.contiguous().view(-1, x.size(-1)), y.contiguous().view(-1))
        return sloss.item(), sloss  # summed over the batch's tokens


class AnnotatedLoop(WindowCursor):
    """The adapter: ``TrainingStep`` over ``run_epoch``."""

    smoothing_convention = "harvard"
    batch_type = Batch
    criterion_type = LabelSmoothing

    def build(self, spec: ProbeSpec) -> None:
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.module = DecoderOnly(spec)
        decay = [p for p in self.module.parameters() if p.dim() >= 2
                 and p is not self.module.embed.weight]
        rest = [p for p in self.module.parameters() if not any(p is q for q in decay)]
        groups = [{"params": decay, "weight_decay": spec.weight_decay},
                  {"params": rest, "weight_decay": 0.0}]
        self.optimizer = (torch.optim.SGD(groups, lr=spec.lr) if spec.optimizer == "sgd" else
                          torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps))
        warmup = max(spec.warmup, 1)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda=lambda step: min(1.0, (step + 1) / warmup))
        self.dataset, self.epoch, self.index = [], 0, 0
        self.scaler = torch.amp.GradScaler("cpu", init_scale=spec.loss_scale or 1.0,
                                           growth_interval=10**9,
                                           enabled=spec.loss_scale is not None)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               document_ids: torch.Tensor) -> torch.Tensor:
        mask = self.batch_type.make_std_mask(document_ids)
        return self.module.generator(self.module(input_ids, position_ids, mask))

    def loss_compute(self, smoothing: float) -> SimpleLossCompute:
        criterion = self.criterion_type(self.spec.vocab_size, self.spec.pad_id, smoothing)
        return SimpleLossCompute(self.module.generator, criterion)

    def run_epoch(self, data_iter: Sequence[Batch], mode: str = "train",
                  accum_iter: int = 1) -> list[float | None] | tuple[float, int]:
        smoothing = self.spec.label_smoothing if mode == "train" else 0.0
        loss_compute = self.loss_compute(smoothing)
        total_loss, total_tokens, logs = 0.0, 0, []
        window_loss, window_tokens = 0.0, 0
        for i, batch in enumerate(data_iter):
            out = self.forward(batch)
            loss, loss_node = loss_compute(out, batch.tgt_y)
            total_loss += loss
            total_tokens += batch.ntokens
            if mode == "train":
                self.scaler.scale(loss_node).backward()
                window_loss += loss
                window_tokens += batch.ntokens
                if self.closes(i, len(data_iter), accum_iter):
                    logs.append(self.close(window_loss, window_tokens))
                    window_loss, window_tokens = 0.0, 0
        return logs if mode == "train" else (total_loss, total_tokens)

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.module.forward(batch.tgt, batch.positions, batch.tgt_mask)

    @staticmethod
    def closes(i: int, n: int, accum_iter: int) -> bool:
        """Batch ``i`` of ``n`` closes a window: every ``accum_iter``-th and the last (U1)."""
        return (i + 1) % accum_iter == 0 or i == n - 1

    def close(self, loss: float, ntokens: int) -> float | None:
        """Unscale, divide by the window's tokens, clip, step; or skip (L4, U4)."""
        if ntokens == 0:
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.scaler.unscale_(self.optimizer)
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad /= ntokens
        max_norm = self.spec.clip if self.spec.clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        if not (math.isfinite(loss) and torch.isfinite(norm)):
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            return None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return loss / ntokens

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        self.module.train()
        batches = [self.batch_type(mb, self.spec.pad_id) for mb in microbatches]
        return self.run_epoch(batches, "train", accum_iter=self.spec.accum)

    def epoch_order(self) -> list[int]:
        """This epoch's order: a ``RandomSampler`` seeded by the spec's seed and the epoch."""
        g = torch.Generator().manual_seed(self.spec.seed * 1_000_003 + self.epoch)
        return list(torch.utils.data.RandomSampler(self.dataset, generator=g))

    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        was_training = self.module.training
        self.module.eval()
        with torch.no_grad():
            batches = [self.batch_type(mb, self.spec.pad_id) for mb in microbatches]
            loss, tokens = self.run_epoch(batches, "eval")
        self.module.train(was_training)
        return loss / tokens, math.exp(loss / tokens)

    def save(self, path: Path) -> None:
        torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "lr_scheduler": self.lr_scheduler.state_dict(),
                    "scaler": self.scaler.state_dict(), "rng": torch.get_rng_state(),
                    "data": (self.epoch, self.index)}, path)

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"])
        self.epoch, self.index = state["data"]


def make() -> AnnotatedLoop:
    """The ``python:`` target's factory: returns a ``TrainingStep``."""
    return AnnotatedLoop()
