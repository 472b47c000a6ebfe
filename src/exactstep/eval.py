"""Held-out evaluation with isolation (E1) and perplexity from global sums (L5).

``evaluate`` switches the model to eval mode under ``torch.no_grad``, forks the RNG
streams so evaluation consumes no randomness of the training run, and restores the
model's previous mode afterwards. It touches no optimizer, scheduler, scaler or
progress state: it only reads parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.cross_entropy import fused_row_losses
from exactstep.objective.perplexity import NotAvailable, perplexity
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.example import Example

LN2 = math.log(2.0)


@dataclass(frozen=True)
class EvalResult:
    """Gold (unsmoothed) NLL summed over ``tokens`` held-out targets (L5)."""

    gold_nll_sum: float
    tokens: int

    @property
    def loss(self) -> float | None:
        return self.gold_nll_sum / self.tokens if self.tokens else None

    @property
    def perplexity(self) -> float | NotAvailable:
        return perplexity(self.gold_nll_sum, self.tokens)

    @property
    def bits_per_token(self) -> float | None:
        return self.gold_nll_sum / LN2 / self.tokens if self.tokens else None


def evaluate(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    *,
    device: torch.device,
    max_tokens: int,
    pad_id: int | None,
    autocast: Callable[[], AbstractContextManager] | None = None,
) -> EvalResult:
    """Sum gold NLL over held-out batches until ``max_tokens`` targets are seen.

    The sums are accumulated on the device and read once at the end (U7 spirit).
    """
    cfg = ObjectiveConfig(label_smoothing=0.0)
    was_training = model.training
    model.eval()
    nll_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for batch in batches:
                if tokens >= max_tokens:
                    break
                n = batch.num_targets()
                if n == 0:
                    continue
                on_device = batch.to(device)
                with autocast() if autocast is not None else nullcontext():
                    hidden = model(on_device)  # [B, T, H]
                _, gold = fused_row_losses(
                    hidden.reshape(-1, hidden.shape[-1]),
                    _head_weight(model),
                    on_device.labels.reshape(-1),
                    cfg,
                    pad_id=pad_id,
                )
                nll_sum += gold.double().sum()
                tokens += n
    finally:
        model.train(was_training)
    return EvalResult(gold_nll_sum=float(nll_sum), tokens=tokens)


def unigram_bits(
    train_examples: Sequence[Example], val_batches: Iterable[Batch], vocab_size: int,
    max_tokens: int,
) -> float | None:
    """Bits per target of a unigram (token-frequency) model fit on the training
    examples' supervised targets (add-one smoothing), scored on the same validation
    targets ``evaluate`` scores. The baseline the summary compares bits per byte to."""
    counts = np.ones(vocab_size, dtype=np.float64)
    for ex in train_examples:
        targets = ex.tokens[1:] if ex.owned is None else ex.tokens[ex.owned]
        counts += np.bincount(targets, minlength=vocab_size)[:vocab_size]
    log2p = torch.from_numpy(np.log2(counts / counts.sum()))
    bits, tokens = 0.0, 0
    for batch in val_batches:
        if tokens >= max_tokens:
            break
        labels = batch.labels[batch.labels != IGNORE_INDEX]
        if labels.numel() == 0:
            continue
        bits -= float(log2p[labels].sum())
        tokens += labels.numel()
    return bits / tokens if tokens else None


def _head_weight(model: torch.nn.Module) -> torch.Tensor:
    inner = getattr(model, "module", model)
    return inner.head_weight
