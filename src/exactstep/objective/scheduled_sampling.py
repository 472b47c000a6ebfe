"""Scheduled sampling (R8): the model's own tokens as inputs, on a declared schedule.

Teacher forcing feeds the gold previous token at every input position. Scheduled
sampling (Bengio et al., 2015) feeds, at each eligible position, the gold token with
probability ``eps(i)`` and otherwise the model's own prediction of it, where ``i``
is the **committed clock** (windows committed so far: a skipped or no-objective
window does not advance it). The targets stay the gold tokens. The estimator is then
no longer teacher-forced maximum likelihood, and the manifest and every ledger line
say so (the family's ``objective`` section; ``inputs`` in the ledger).

Schedules (``[scheduled_sampling]``; ``floor`` bounds each from below):

- ``inverse_sigmoid``: ``eps(i) = k / (k + exp(i / k))``, ``k >= 1``;
- ``linear``: ``eps(i) = 1 - slope * i``;
- ``exponential``: ``eps(i) = base ** i``, ``0 < base <= 1``;
- ``constant``: ``eps(i) = probability``.

Eligible positions: column ``c`` of a segment, not its first column, whose input is
the gold target of row ``c - 1`` (``labels[c - 1] == input_ids[c]``): exactly the
inputs teacher forcing takes from the targets. A chat prompt token is not a target,
so it is never replaced; a segment's first token never is.

The coin of each position is a declared RNG stream addressed by
``(seed, window, example id, piece)``: one NumPy generator per segment, one uniform
draw per column of the segment, ``model input iff u >= eps``. Packing, the batch a
segment lands in and resuming never change an example's coins (S5).

Sequential input construction, exactly: the model's token at column ``c`` is the
argmax of its prediction at ``c - 1`` given the inputs *as constructed so far*
(every replacement at a column before ``c`` already made). The columns holding any
replacement are visited in increasing order; at each, one no-grad forward of the
batch truncated to its first ``c`` columns (exact under causal visibility: column
``c - 1`` sees nothing later) gives the predictions for every row at once. The cost
is one forward of the growing prefix per such column (about ``T / 2`` full forwards
per microbatch when replacements are dense). An encoder-decoder batch is not cut (a
decoder segment is only valid with its source segment), so it costs up to ``T``
full forwards. The construction runs the model as it
trains (train mode, the window's autocast), without gradients; the built-in decoder
has no dropout, so it draws from no RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from exactstep.objective.scheduled_sampling_config import ScheduledSamplingConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.transfer import host_to_device

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
    """Bool ``[B, T]`` (host): where the input becomes the model's token (see module doc).

    ``batch`` must be on the host (labels and ids are read there, before the forward).
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
    ``mask``, built sequentially column by column (see module doc)."""
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
