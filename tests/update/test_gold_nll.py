"""L2: the gold (unsmoothed) NLL is reported beside the optimized loss in every ledger line.

``loss`` is the window's objective S / D (smoothed, under the declared reduction);
``gold_nll`` is the unsmoothed NLL per supervised target token of the window. Both are
checked against an independent float64 computation from the model's logits (written
here, not the objective stage), through the real engine, plan and fused loss. Each
check is also run on a deliberately wrong ledger line (the smoothed loss reported as
the gold NLL, or the gold sum divided by D) and must fail there.
"""

from __future__ import annotations

import math

import pytest
import torch
from equivalence import linear_cross_entropy_bounds, smoothed_targets
from update_support import PAD, TinyLM, make_batch

from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

EPS = 0.1


def engine_for(objective: ObjectiveConfig) -> UpdateEngine:
    """The real engine with the real objective stage (plan_window + fused CE)."""
    model = TinyLM(seed=3)
    cfg = UpdateConfig(schedule="constant", warmup=0, clip=0.0, weight_decay=0.0)
    optimizer, _ = build_optimizer(model, cfg)
    return UpdateEngine(
        model,
        optimizer,
        build_schedule(cfg, 10),
        Precision(NumericsConfig(), "cpu"),
        cfg,
        objective,
        device="cpu",
        pad_id=PAD,
    )


def window() -> list[Batch]:
    """Two microbatches with ignored rows and padding-like gaps."""
    x = IGNORE_INDEX
    first = make_batch(
        [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 1, 2]],
        [[2, 3, 4, x, x, x], [8, 9, 10, 1, 2, 3]],
    )
    second = make_batch([[3, 5, 7, 9, 0, 0]], [[5, 7, 9, x, x, x]])
    return [first, second]


def reference_rows(model: TinyLM, batches: list[Batch], eps: float) -> tuple[list, list]:
    """Per supervised row, in float64: (gold NLL, uniform-smoothed CE) from the logits."""
    nll, smoothed = [], []
    with torch.no_grad():
        for batch in batches:
            logits = (model(batch) @ model.head_weight.t()).double()  # [B, T, V]
            logp = torch.log_softmax(logits, dim=-1)
            mask = batch.labels != IGNORE_INDEX
            rows = logp[mask]  # [N, V]
            gold = -rows.gather(1, batch.labels[mask].unsqueeze(1)).squeeze(1)  # [N]
            nll += gold.tolist()
            smoothed += ((1.0 - eps) * gold - eps * rows.mean(dim=1)).tolist()
    return nll, smoothed


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def tolerances(model: TinyLM, batches: list[Batch], eps: float) -> tuple[float, float]:
    """(smoothed, gold) token means: twice the worst-case fp32 rounding bound of each
    (``tests/equivalence.py``): the engine's fused loss and the reference's fp32 logits
    both round from the same hidden states and head."""
    with torch.no_grad():
        hidden = torch.cat([model(b).flatten(0, 1) for b in batches])  # [N, H]
    labels = torch.cat([b.labels.flatten() for b in batches])
    weight = model.head_weight.detach()
    coeff = (labels != IGNORE_INDEX).double() / int((labels != IGNORE_INDEX).sum())
    return tuple(2 * linear_cross_entropy_bounds(
        hidden, weight, smoothed_targets(labels, weight.shape[0], e, IGNORE_INDEX), coeff)[0]
        for e in (eps, 0.0))


def reports_gold_beside_loss(record: dict, nll: list[float], smoothed: list[float],
                             tol: tuple[float, float]) -> bool:
    """``loss`` is the smoothed token mean, ``gold_nll`` the gold token mean, and the gap
    between them is the independent smoothing gap (each within ``tol``)."""
    gap = mean(smoothed) - mean(nll)
    return (
        abs(record["loss"] - mean(smoothed)) <= tol[0]
        and abs(record["gold_nll"] - mean(nll)) <= tol[1]
        and abs((record["loss"] - record["gold_nll"]) - gap) <= tol[0] + tol[1]
    )


def test_without_smoothing_gold_nll_equals_loss_bitwise_l2() -> None:
    engine = engine_for(ObjectiveConfig(reduction="token_mean", label_smoothing=0.0))
    batches = window()
    nll, _ = reference_rows(engine.model, batches, 0.0)
    tol = tolerances(engine.model, batches, 0.0)[1]
    record = engine.run_window(batches, 0).ledger_record()
    assert record["disposition"] == "COMMITTED" and record["tokens"] == len(nll) == 12
    assert record["gold_nll"] == record["loss"]  # same sum, same count: bit for bit
    assert record["loss"] == pytest.approx(mean(nll), abs=tol)


def test_with_smoothing_gold_nll_differs_by_the_smoothing_gap_l2() -> None:
    engine = engine_for(ObjectiveConfig(reduction="token_mean", label_smoothing=EPS))
    batches = window()
    nll, smoothed = reference_rows(engine.model, batches, EPS)
    tol = tolerances(engine.model, batches, EPS)
    disposition = engine.run_window(batches, 0)
    record = disposition.ledger_record()
    assert disposition.gold_loss == record["gold_nll"]
    assert reports_gold_beside_loss(record, nll, smoothed, tol)
    # the gap is far larger than the tolerance, so the check can tell the two apart
    assert abs(mean(smoothed) - mean(nll)) > 100 * sum(tol)


def test_negative_control_smoothed_loss_reported_as_gold_is_caught_l2() -> None:
    engine = engine_for(ObjectiveConfig(reduction="token_mean", label_smoothing=EPS))
    batches = window()
    nll, smoothed = reference_rows(engine.model, batches, EPS)
    tol = tolerances(engine.model, batches, EPS)
    record = engine.run_window(batches, 0).ledger_record()
    wrong = {**record, "gold_nll": record["loss"]}  # what the ledger said before L2
    assert not reports_gold_beside_loss(wrong, nll, smoothed, tol)


def test_gold_nll_is_per_target_token_whatever_the_reduction_l2() -> None:
    """Under sequence_mean the loss averages per document; gold_nll stays a token mean.
    Negative control: the gold sum divided by D (documents) is a different number."""
    engine = engine_for(ObjectiveConfig(reduction="sequence_mean", label_smoothing=0.0))
    batches = window()
    nll, _ = reference_rows(engine.model, batches, 0.0)
    tol = tolerances(engine.model, batches, 0.0)[1]
    disposition = engine.run_window(batches, 0)
    record = disposition.ledger_record()
    assert record["D"] == 2.0  # example ids 0 and 1 (make_batch numbers rows per batch)
    assert record["gold_nll"] == pytest.approx(mean(nll), abs=tol)
    wrong = disposition.gold_nll_sum / disposition.denominator
    assert abs(wrong - mean(nll)) > 1000 * tol


def test_no_objective_window_has_no_gold_nll_l2_l4() -> None:
    engine = engine_for(ObjectiveConfig())
    x = IGNORE_INDEX
    empty = make_batch([[1, 2, 3]], [[x, x, x]])
    disposition = engine.run_window([empty], 0)
    assert disposition.outcome is Outcome.NO_OBJECTIVE
    record = disposition.ledger_record()
    assert record["gold_nll"] is None and record["loss"] is None


def test_logits_path_gold_sum_equals_numerator_bitwise_l2() -> None:
    """The logits-only terms (for models without a fused head) keep the same promise."""
    from exactstep.objective import logits_microbatch_terms

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 7, 11, generator=gen)  # [B, T, V]
    labels = torch.randint(0, 11, (2, 7), generator=gen)
    labels[0, 3:] = IGNORE_INDEX
    coeff = (labels != IGNORE_INDEX).float()  # token_mean's a_r
    numerator, gold = logits_microbatch_terms(logits, labels, coeff, ObjectiveConfig(), pad_id=PAD)
    assert torch.equal(numerator, gold)
    reference = torch.nn.functional.cross_entropy(
        logits.double().reshape(-1, 11), labels.reshape(-1), reduction="sum"
    )
    assert float(gold) == pytest.approx(float(reference), rel=1e-6)
