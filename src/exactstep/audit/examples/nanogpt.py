"""A nanoGPT-style training loop, correct, wrapped for ``exactstep audit`` (A1, A2).

Run it with ``exactstep audit --target python:exactstep.audit.examples.nanogpt:make``.
nanoGPT's model and loop, with attention kept inside each token's document (R3) and the
few changes that make it exact (U1, L4, U4, S2). Each step is a small method, so a
wrong variant (tests/audit/audit_wrong_loops.py) changes one of them.
Design and derivations: docs/design/audit.md#auditexamplesnanogptpy (A1, A2).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from exactstep.audit.protocol import Microbatch, ProbeSpec, WindowCursor

IGNORE = -100


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_heads, self.dropout = n_heads, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in (q, k, v))  # [B, h, T, Dh]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, spec: ProbeSpec, block_size: int = 64) -> None:
        super().__init__()
        d = spec.d_model
        self.wte = nn.Embedding(spec.vocab_size, d)
        self.wpe = nn.Embedding(block_size, d)
        self.drop = nn.Dropout(spec.dropout)
        self.h = nn.ModuleList(Block(d, spec.n_heads, spec.dropout)
                               for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, spec.vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, 0.0, 0.02)

    def attention_mask(self, documents: torch.Tensor) -> torch.Tensor:
        """``[B, T, T]``: causal, and only within the token's own document (R2, R3)."""
        T = documents.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        return causal & (documents[:, :, None] == documents[:, None, :])

    def forward(self, idx: torch.Tensor, pos: torch.Tensor,
                documents: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        mask = self.attention_mask(documents)
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))  # [B, T, V]


class NanoGPTLoop(WindowCursor):
    """The adapter: ``TrainingStep`` over a nanoGPT-style loop."""

    smoothing_convention = "uniform"  # F.cross_entropy(label_smoothing=...) (L2)
    model_type = GPT
    data_parallel = True  # train() under a process group is one rank of a DDP job

    def build(self, spec: ProbeSpec) -> None:
        torch.manual_seed(spec.seed)
        self.spec = spec
        self.module = self.model_type(spec)
        self.optimizer = self.configure_optimizer()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=spec.loss_scale or 1.0,
                                           growth_interval=10**9,
                                           enabled=spec.loss_scale is not None)
        self.iter_num = 0
        self.dataset, self.data_seed, self.epoch, self.index = [], spec.seed, 0, 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.model = (nn.parallel.DistributedDataParallel(self.module) if self.world > 1
                      else self.module)  # what training calls; self.module is the model

    def configure_optimizer(self) -> torch.optim.Optimizer:
        embeddings = {id(m.weight) for m in self.module.modules() if isinstance(m, nn.Embedding)}
        params = list(self.module.parameters())
        decay = [p for p in params if p.dim() >= 2 and id(p) not in embeddings]
        no_decay = [p for p in params if p.dim() < 2 or id(p) in embeddings]
        groups = [{"params": decay, "weight_decay": self.spec.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if self.spec.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=self.spec.lr)
        return torch.optim.AdamW(groups, lr=self.spec.lr, betas=self.spec.betas,
                                 eps=self.spec.eps)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               document_ids: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids, position_ids, document_ids)

    def get_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        """``x, pos, docs, y`` (each [B, L-1]); ``y`` is IGNORE where not supervised."""
        x, y = mb.tokens[:, :-1], mb.tokens[:, 1:]
        keep = mb.owned[:, 1:] & (mb.documents[:, 1:] == mb.documents[:, :-1])
        return x, mb.positions[:, :-1], mb.documents[:, :-1], y.masked_fill(~keep, IGNORE)

    def loss_sum(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                               ignore_index=IGNORE, reduction="sum",
                               label_smoothing=self.spec.label_smoothing)

    def get_lr(self, it: int) -> float:
        if self.spec.warmup <= 0:
            return self.spec.lr
        return self.spec.lr * min(1.0, (it + 1) / self.spec.warmup)

    def windows(self, microbatches: Sequence[Microbatch]) -> list[Sequence[Microbatch]]:
        k = self.spec.accum
        return [microbatches[i:i + k] for i in range(0, len(microbatches), k)]

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        self.module.train()
        return [self.train_window(window) for window in self.windows(microbatches)]

    def train_window(self, window: Sequence[Microbatch]) -> float | None:
        batches = [self.get_batch(mb) for mb in window]
        n_tokens = self.global_count(sum(int((y != IGNORE).sum()) for *_, y in batches))
        if n_tokens == 0:
            return None  # no objective: nothing to step, nothing to log (L4)
        total = 0.0
        for i, (x, pos, docs, y) in enumerate(batches):
            with self.sync(last=i == len(batches) - 1):
                loss = self.micro_loss(self.model(x, pos, docs), y, n_tokens, len(batches))
                self.scaler.scale(loss).backward()
            total += loss.item()
        return self.close_window(total)

    def global_count(self, n: int) -> int:
        """The window's supervised targets summed over ranks: its denominator (D1)."""
        if self.world == 1:
            return n
        count = torch.tensor([n])
        dist.all_reduce(count)
        return int(count)

    def sync(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP syncs gradients on the window's last micro-step only (forward and
        backward of the others under ``no_sync``)."""
        if self.world == 1 or last:
            return contextlib.nullcontext()
        return self.model.no_sync()

    def micro_loss(self, logits: torch.Tensor, y: torch.Tensor, n_tokens: int,
                   n_micro: int) -> torch.Tensor:
        """This micro-step's share of the window's token mean (U1); times the world
        size because DDP averages over ranks (D1)."""
        return self.loss_sum(logits, y) * self.world / n_tokens

    def clip(self) -> torch.Tensor:
        max_norm = self.spec.clip if self.spec.clip > 0 else math.inf
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def unscale_and_clip(self) -> torch.Tensor:
        self.scaler.unscale_(self.optimizer)
        return self.clip()

    def step_optimizer(self) -> None:
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def finite(self, loss: float, norm: torch.Tensor) -> bool:
        """The window commits only when its loss and its unscaled gradient norm are both
        finite (U4): a finite loss can carry a non-finite gradient."""
        return math.isfinite(loss) and bool(torch.isfinite(norm))

    def close_window(self, loss: float) -> float | None:
        norm = self.unscale_and_clip()
        if not self.finite(loss, norm):
            self.scaler.update()  # backs off; no step, iter_num unchanged (U4)
            self.zero_grad()
            return None
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(self.iter_num)
        self.step_optimizer()
        self.zero_grad()
        self.iter_num += 1
        return loss

    def epoch_order(self) -> list[int]:
        g = torch.Generator().manual_seed(self.data_seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.dataset), generator=g).tolist()

    @torch.no_grad()
    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        was_training = self.module.training
        self.module.eval()
        nll, count = 0.0, 0
        for mb in microbatches:
            x, pos, docs, y = self.get_eval_batch(mb)
            nll += self.eval_nll(self.module(x, pos, docs), y).item()
            count += self.eval_count(y)
        self.module.train(was_training)
        return nll / count, math.exp(nll / count)

    def get_eval_batch(self, mb: Microbatch) -> tuple[torch.Tensor, ...]:
        return self.get_batch(mb)

    def eval_nll(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gold NLL summed over the supervised targets: no smoothing (L5)."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                               ignore_index=IGNORE, reduction="sum")

    def eval_count(self, y: torch.Tensor) -> int:
        return int((y != IGNORE).sum())

    def save(self, path: Path) -> None:
        torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scaler": self.scaler.state_dict(), "iter_num": self.iter_num,
                    "rng": torch.get_rng_state(), "data": self.data_position()}, path)

    def data_position(self) -> dict:
        return {"seed": self.data_seed, "epoch": self.epoch, "index": self.index}

    def load_data_position(self, position: dict) -> None:
        self.data_seed, self.epoch, self.index = (position["seed"], position["epoch"],
                                                  position["index"])

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.iter_num = state["iter_num"]
        torch.set_rng_state(state["rng"])
        self.load_data_position(state["data"])


def make() -> NanoGPTLoop:
    """The ``python:`` target's factory: returns a ``TrainingStep``."""
    return NanoGPTLoop()
