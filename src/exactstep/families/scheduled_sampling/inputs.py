"""Scheduled sampling (R8): the model's own tokens as inputs, on a declared schedule.

An input program for the update stage (``UpdateEngine(inputs=)``): before each
microbatch's forward, eligible inputs become the model's argmax tokens with
probability ``1 - eps(committed clock)``, built column by column without gradients.
The targets stay gold; coins are addressed by example, so packing and resuming never
change them (S5); the manifest and the ledger record the estimator.
Design and derivations: docs/design/families.md#familiesscheduled_samplinginputspy (R8, S5).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from exactstep.families.scheduled_sampling.config import ScheduledSamplingConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.transfer import host_to_device

RNG_TAG = 0x55  # the scheduled-sampling coin stream (distinct from other addressed draws)


def eligible_columns(batch: Batch, b: int, seg: Segment) -> np.ndarray:
    """Bool ``[seg.length]``: column ``k`` of ``seg`` takes its input from the previous
    row's gold target (``k >= 1`` and ``labels[k - 1] == input_ids[k]``)."""
    ids = batch.input_ids[b, seg.start:seg.stop].numpy()
    labels = batch.labels[b, seg.start:seg.stop].numpy()
    eligible = np.zeros(seg.length, dtype=bool)
    eligible[1:] = (labels[:-1] != IGNORE_INDEX) & (labels[:-1] == ids[1:])
    return eligible


def model_input_mask(batch: Batch, eps: float, *, seed: int, window: int) -> np.ndarray:
    """Bool ``[B, T]`` (host): where the input becomes the model's token.

    Eligible columns (``eligible_columns``) whose coin ``u >= eps``; one NumPy stream
    per segment addressed by ``(seed, window, example_id, piece)``, one draw per column,
    so packing and resuming never change an example's coins (S5). ``batch`` must be on
    the host (labels and ids are read there, before the forward).
    """
    B, T = batch.shape
    mask = np.zeros((B, T), dtype=bool)
    if eps >= 1.0:
        return mask
    for b, row in enumerate(batch.segments):
        for seg in row:
            coins = np.random.default_rng(
                [seed, RNG_TAG, window, seg.example_id, seg.piece]).random(seg.length)
            mask[b, seg.start:seg.stop] = eligible_columns(batch, b, seg) & (coins >= eps)
    return mask


def prefix_batch(batch: Batch, columns: int) -> Batch:
    """``batch`` cut to its first ``columns`` columns (segments clipped), for a forward
    whose last column's prediction sees exactly what it would in the whole row."""
    segments = tuple(
        tuple(s._replace(length=min(s.stop, columns) - s.start) for s in row if s.start < columns)
        for row in batch.segments
    )

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:, :columns]

    return replace(batch, input_ids=cut(batch.input_ids), labels=cut(batch.labels),
                   position_ids=cut(batch.position_ids), segment_ids=cut(batch.segment_ids),
                   weights=cut(batch.weights), segments=segments)


@torch.no_grad()
def construct_inputs(model: nn.Module, batch: Batch, mask: np.ndarray,
                     autocast: Callable[[], AbstractContextManager]) -> torch.Tensor:
    """Input ids ``[B, T]`` on ``batch``'s device with the model's argmax tokens at
    ``mask``, built sequentially: the token at column ``c`` is the argmax at ``c - 1``
    given every earlier replacement, from one no-grad forward of the first ``c``
    columns (the whole batch for an encoder-decoder). Runs the model as it trains
    (the caller's mode and ``autocast``)."""
    ids = batch.input_ids.clone()
    where = host_to_device(torch.from_numpy(mask), ids.device)  # [B, T] bool
    head = model.head_weight
    for c in np.flatnonzero(mask.any(axis=0)).tolist():
        current = replace(batch, input_ids=ids)
        # the decoder side cut to c columns; an encoder-decoder batch keeps every row's
        # pairs whole (each decoder segment must meet its source), still exact: the
        # decoder is causal, so column c - 1 sees no later column either way
        step = current if batch.source is not None else prefix_batch(current, c)
        with autocast():
            hidden = model(step)  # [B, c or T, H]
        predicted = F.linear(hidden[:, c - 1].float(), head.float()).argmax(dim=-1)  # [B]
        ids[:, c] = torch.where(where[:, c], predicted, ids[:, c])
    return ids


class ScheduledSampling:
    """The engine's input program for scheduled sampling (``UpdateEngine(inputs=)``)."""

    def __init__(self, cfg: ScheduledSamplingConfig, *, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed

    def construct(self, model: nn.Module, host: Batch, device_batch: Batch, *, clock: int,
                  window: int, autocast: Callable[[], AbstractContextManager]
                  ) -> tuple[Batch, dict]:
        """The microbatch the window trains on, and what the ledger records of it."""
        eps = self.cfg.gold_probability(clock)
        mask = model_input_mask(host, eps, seed=self.seed, window=window)
        info = {"gold_probability": eps, "model_inputs": int(mask.sum())}
        if not mask.any():
            return device_batch, info
        ids = construct_inputs(model, device_batch, mask, autocast)
        return replace(device_batch, input_ids=ids), info
