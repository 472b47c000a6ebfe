"""The window's objective plan: L3 coefficients and the L4 decision, before any forward.

``plan_window`` turns the labels, row addresses and weights of a whole window into
each row's coefficient ``a_r`` and the denominator ``D = sum b_r`` of the declared
reduction, on the host, so that accumulation (U1) and the all-reduce of ``D`` (D1)
stay exact; ``D == 0`` is ``NoObjective`` (L4). The update stage runs the plan.
Design and derivations: docs/design/objective.md#objectiveplanpy (L3, L4, U1, D1, R6).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from exactstep.errors import ObjectiveError
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.types import NoObjective, NoObjectiveCause
from exactstep.rows.batch import IGNORE_INDEX, Batch


@dataclass(frozen=True)
class WindowPlan:
    """Host-side L3 coefficients of one window (no device sync; built before the forward).

    ``coefficients[m]``: ``a_r`` of microbatch ``m``, ``[B, T]`` float32 CPU, 0 where
    not supervised. ``denominator``: ``D_W = sum b_r`` over this process's share of the
    window (the distributed path all-reduces it). ``tokens``: supervised rows in the
    window. ``microbatch_denominators[m]``: ``sum b_r`` of microbatch ``m``.
    ``row_indices[m]``: flat indices (into ``B * T``) of microbatch ``m``'s supervised
    rows, int64 CPU, to pass as ``rows_index`` so ignored rows are skipped without a
    device sync. ``microbatch_tokens[m]``: supervised rows of microbatch ``m``.
    """

    coefficients: list[torch.Tensor]
    denominator: float
    tokens: int
    microbatch_denominators: list[float]
    row_indices: list[torch.Tensor] = field(default_factory=list)
    microbatch_tokens: list[int] = field(default_factory=list)


def no_objective(denominator: float, tokens: int) -> NoObjective | None:
    """The L4 decision from (globally reduced) ``D`` and token count; ``None`` if there is one.

    ``D == 0`` with no supervised row is ``EMPTY_ELIGIBLE_SET``; with supervised rows
    whose weights sum to 0 it is ``NONEMPTY_ZERO_WEIGHT_MASS``.
    """
    if denominator != 0.0:
        return None
    if tokens == 0:
        return NoObjective(NoObjectiveCause.EMPTY_ELIGIBLE_SET)
    return NoObjective(NoObjectiveCause.NONEMPTY_ZERO_WEIGHT_MASS)


def plan_window(
    batches: Sequence[Batch], cfg: ObjectiveConfig, *, allow_empty: bool = False
) -> WindowPlan | NoObjective:
    """Coefficients ``a_r`` and denominator ``D`` of one window under ``cfg.reduction`` (L3).

    Returns ``NoObjective`` when ``D == 0`` (L4), decided over the whole window: an
    empty microbatch next to a non-empty one is normal. With ``allow_empty=True`` a
    plan with ``D == 0`` is returned instead, for the distributed path, which decides
    L4 with ``no_objective`` after all-reducing ``D`` and ``tokens`` (a locally empty
    rank still runs its microbatches).

    Invariants: coefficients are 0 on unsupervised rows and ``sum(b_r) == D``; no
    device is touched. Raises ``ObjectiveError`` for labels already on an accelerator,
    ``weighted*`` without ``batch.weights`` or with negative or non-finite weights on
    supervised rows, and ``sequence_mean`` with a supervised row no segment covers.
    """
    masks = [supervised_mask(batch, m) for m, batch in enumerate(batches)]
    tokens_per_mb = [int(mask.sum()) for mask in masks]
    a_list, b_list = reduction_coefficients(batches, masks, tokens_per_mb, cfg.reduction)
    mb_denominators = [math.fsum(b[mask].tolist()) for b, mask in zip(b_list, masks, strict=True)]
    denominator = exact_denominator(cfg.reduction, b_list, masks, batches, mb_denominators)
    tokens = sum(tokens_per_mb)
    if not allow_empty:
        decision = no_objective(denominator, tokens)
        if decision is not None:
            return decision
    return WindowPlan(
        coefficients=a_list,
        denominator=denominator,
        tokens=tokens,
        microbatch_denominators=mb_denominators,
        row_indices=[mask.reshape(-1).nonzero().squeeze(1) for mask in masks],
        microbatch_tokens=tokens_per_mb,
    )


def exact_denominator(
    reduction: str,
    b_list: list[torch.Tensor],
    masks: list[torch.Tensor],
    batches: Sequence[Batch],
    mb_denominators: list[float],
) -> float:
    """``D = sum b_r``, counted exactly where it is a count (documents, microbatches).

    Summing ``1 / n`` shares in floating point can miss an integer by one ulp; a count
    never does, and an exact ``D`` makes every rank's all-reduce agree bit for bit.
    """
    if reduction == "microbatch_mean":
        return float(sum(1 for mask in masks if bool(mask.any())))
    if reduction == "sequence_mean":
        docs = [
            document_ids(b, mask, m)[mask]
            for m, (b, mask) in enumerate(zip(batches, masks, strict=True))
        ]
        return float(torch.unique(torch.cat(docs)).numel()) if docs else 0.0
    return math.fsum(mb_denominators)


def supervised_mask(batch: Batch, microbatch: int) -> torch.Tensor:
    """``labels != IGNORE_INDEX`` as a CPU bool ``[B, T]``; refuses device labels."""
    if batch.labels.device.type != "cpu":
        raise ObjectiveError(
            f"microbatch {microbatch}: plan the window before moving its batches to "
            f"{batch.labels.device}; planning on the host avoids a device sync (U7)"
        )
    return batch.labels != IGNORE_INDEX


def reduction_coefficients(
    batches: Sequence[Batch],
    masks: list[torch.Tensor],
    tokens_per_mb: list[int],
    reduction: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-microbatch ``(a [B, T], b [B, T])`` float32, zero where not supervised."""
    ones = [mask.to(torch.float32) for mask in masks]
    if reduction == "token_mean":
        return ones, ones
    if reduction == "microbatch_mean":
        per_mb = [one / n if n else one for one, n in zip(ones, tokens_per_mb, strict=True)]
        return per_mb, per_mb
    if reduction == "sequence_mean":
        per_doc = document_coefficients(batches, masks)
        return per_doc, per_doc
    if reduction in ("weighted", "weighted_count"):
        weights = [
            row_weights(b, mask, m, reduction)
            for m, (b, mask) in enumerate(zip(batches, masks, strict=True))
        ]
        return weights, (weights if reduction == "weighted" else ones)
    raise ObjectiveError(
        "objective.reduction must be one of token_mean, sequence_mean, microbatch_mean, "
        f"weighted, weighted_count; got {reduction!r}"
    )


def row_weights(
    batch: Batch, mask: torch.Tensor, microbatch: int, reduction: str = "weighted"
) -> torch.Tensor:
    """``w_r`` on supervised rows (0 elsewhere), validated: finite and non-negative.

    ``batch.weights`` may be ``None`` only when no row of the microbatch is supervised.
    """
    if batch.weights is None:
        if not bool(mask.any()):
            return torch.zeros(mask.shape, dtype=torch.float32)
        raise ObjectiveError(
            f"microbatch {microbatch} has supervised rows but no weights; "
            f"objective.reduction = '{reduction}' needs a numeric \"weight\" field on "
            "every example of the data (each text JSONL line or chat conversation), "
            "or set objective.reduction = token_mean"
        )
    if tuple(batch.weights.shape) != tuple(mask.shape):
        raise ObjectiveError(
            f"microbatch {microbatch}: weights {tuple(batch.weights.shape)} must have the "
            f"labels' shape {tuple(mask.shape)}"
        )
    weights = torch.where(mask, batch.weights.detach().cpu().to(torch.float32), 0.0)
    bad = mask & ~(torch.isfinite(weights) & (weights >= 0))
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ObjectiveError(
            f"microbatch {microbatch}, row ({b}, {t}) of example "
            f"{example_at(batch, b, t)}: weight {float(batch.weights[b, t])} must be finite "
            "and >= 0"
        )
    return weights


def document_coefficients(
    batches: Sequence[Batch], masks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``1 / n_doc`` on each supervised row, ``n_doc`` counted over the whole window."""
    doc_ids = [
        document_ids(batch, mask, m)
        for m, (batch, mask) in enumerate(zip(batches, masks, strict=True))
    ]
    supervised_docs = (
        torch.cat([d[mask] for d, mask in zip(doc_ids, masks, strict=True)])
        if masks
        else torch.zeros(0, dtype=torch.int64)
    )
    if supervised_docs.numel() == 0:
        return [mask.to(torch.float32) for mask in masks]
    _, inverse, counts = torch.unique(supervised_docs, return_inverse=True, return_counts=True)
    shares = 1.0 / counts.to(torch.float64)[inverse]  # per supervised row, window order
    out, cursor = [], 0
    for mask in masks:
        coeff = torch.zeros(mask.shape, dtype=torch.float32)
        n = int(mask.sum())
        coeff[mask] = shares[cursor : cursor + n].to(torch.float32)
        cursor += n
        out.append(coeff)
    return out


def document_ids(batch: Batch, mask: torch.Tensor, microbatch: int) -> torch.Tensor:
    """``example_id`` of every column (``-1`` where no segment), ``[B, T]`` int64."""
    ids = torch.full(mask.shape, -1, dtype=torch.int64)
    for b, row_segments in enumerate(batch.segments):
        for seg in row_segments:
            ids[b, seg.start : seg.stop] = seg.example_id
    orphan = mask & (ids < 0)
    if bool(orphan.any()):
        b, t = (int(i) for i in orphan.nonzero()[0])
        raise ObjectiveError(
            f"microbatch {microbatch}, row ({b}, {t}) is supervised but no segment "
            "covers it; objective.reduction=sequence_mean needs row addresses (R6) "
            "on every supervised row"
        )
    return ids


def example_at(batch: Batch, b: int, t: int) -> int | str:
    for seg in batch.segments[b] if b < len(batch.segments) else ():
        if seg.start <= t < seg.stop:
            return seg.example_id
    return "?"
