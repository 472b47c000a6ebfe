"""Interval lines of ``metrics.jsonl`` are sums over their windows, divided once
(L3, L5, X3).

A metrics line covering several windows (``train.log_every > 1``) must report
``loss = sum S / sum D`` over that interval's committed ledger lines (``S = loss *
D`` per window) and ``gold_nll = sum(gold_nll * tokens) / sum(tokens)``, never a
mean of the windows' means. The expectation is computed here from ``ledger.jsonl``
alone. The run is built so the difference shows: documents of very unequal length
under ``sequence_mean`` (a window's ``D`` is its document count, which varies many
times over) with label smoothing (``loss`` and ``gold_nll`` differ), and the test
asserts that the mean of the window means misses the right value by more than the
tolerance. Negative control: the same check on a run whose meter averages the
window means fails.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from run_support import set_args, write_texts

import exactstep.run.report as report
from exactstep.cli import main
from exactstep.update.disposition import Outcome

REL = 1e-9  # both sides are float64 sums of the same logged values
MISS = 1000 * REL  # a mean of means must be off by far more than the tolerance
LOG_EVERY, STEPS = 3, 7  # intervals of 3, 3 and 1 windows


def texts() -> list[str]:
    """Runs of one-word documents between long ones: windows of one or two long
    documents and windows of a dozen short ones."""
    words = "amber birch cedar dune elm fern gorse heath iris juniper".split()
    out = []
    for i in range(60):
        if i % 10 < 6:
            out.append(words[i % len(words)])
        else:
            out.append(" ".join(words[(i * 3 + j) % len(words)] for j in range(18)))
    return out


def run_args(source: Path, out: Path) -> list[str]:
    return ["train", "--out", str(out), "--no-progress", *set_args({
        "seed": 1, "data.source": source, "data.val_fraction": 0.2, "batch.seq_len": 64,
        "batch.rows": 2, "batch.buffer": 4, "model.d_model": 16, "model.n_layers": 1,
        "model.n_heads": 2, "model.d_ff": 32, "objective.reduction": "sequence_mean",
        "objective.label_smoothing": 0.1, "update.warmup": 1, "train.steps": STEPS,
        "train.log_every": LOG_EVERY, "train.eval_tokens": 64, "train.threads": 1,
        "train.device": "cpu"})]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def interval_problems(run: Path) -> tuple[list[str], list[float], list[float]]:
    """Every difference between the interval lines and the ledger's sums, and how far
    a mean of the window means would be off (relative) for each interval of several
    committed windows: (problems, loss misses, gold misses)."""
    ledger = records(run / "ledger.jsonl")
    intervals = [m for m in records(run / "metrics.jsonl") if "tokens_per_s" in m]
    problems: list[str] = []
    loss_miss: list[float] = []
    gold_miss: list[float] = []
    previous = 0
    for line in intervals:
        mine = [r for r in ledger if previous <= r["window"] < line["window"]
                and r["disposition"] == Outcome.COMMITTED.value]
        previous = line["window"]
        s = math.fsum(r["loss"] * r["D"] for r in mine)
        d = math.fsum(r["D"] for r in mine)
        nll = math.fsum(r["gold_nll"] * r["tokens"] for r in mine)
        tokens = sum(r["tokens"] for r in mine)
        loss, gold = s / d, nll / tokens
        if not math.isclose(line["loss"], loss, rel_tol=REL):
            problems.append(f"window {line['window']}: loss {line['loss']} != sum S / sum D "
                            f"{loss}")
        if not math.isclose(line["gold_nll"], gold, rel_tol=REL):
            problems.append(f"window {line['window']}: gold_nll {line['gold_nll']} != "
                            f"token-weighted {gold}")
        if line["supervised_tokens"] != tokens:
            problems.append(f"window {line['window']}: {line['supervised_tokens']} tokens, "
                            f"ledger {tokens}")
        if len(mine) > 1:
            loss_miss.append(abs(sum(r["loss"] for r in mine) / len(mine) - loss) / loss)
            gold_miss.append(abs(sum(r["gold_nll"] for r in mine) / len(mine) - gold) / gold)
    if [m["window"] for m in intervals] != [3, 6, 7]:
        problems.append(f"interval lines at {[m['window'] for m in intervals]}, not 3, 6, 7")
    return problems, loss_miss, gold_miss


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_texts(tmp_path_factory.mktemp("report") / "docs.jsonl", texts())


def test_interval_loss_and_gold_nll_are_sums_over_the_intervals_windows(
        corpus: Path, tmp_path: Path) -> None:
    assert main(run_args(corpus, tmp_path / "run")) == 0
    problems, loss_miss, gold_miss = interval_problems(tmp_path / "run")
    assert problems == []
    # the run can tell the right value from a mean of means, in both figures
    assert loss_miss and min(loss_miss) > MISS, loss_miss
    assert gold_miss and min(gold_miss) > MISS, gold_miss
    ledger = records(tmp_path / "run" / "ledger.jsonl")
    assert len({r["D"] for r in ledger}) > 2 and len({r["tokens"] for r in ledger}) > 2


class MeanOfMeans(report.Meter):
    """The wrong meter: each committed window's loss and gold NLL weigh the same."""

    def add(self, disp, slots: int) -> None:
        if disp.outcome is Outcome.COMMITTED and disp.loss is not None:
            disp = type(disp)(**{**disp.__dict__, "denominator": 1.0,
                                 "gold_nll_sum": disp.gold_nll_sum / disp.tokens, "tokens": 1})
        super().add(disp, slots)


def test_negative_control_a_mean_of_window_means_fails_the_check(
        corpus: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(report, "Meter", MeanOfMeans)
    assert main(run_args(corpus, tmp_path / "run")) == 0
    problems, _, _ = interval_problems(tmp_path / "run")
    assert any("loss" in p for p in problems) and any("gold_nll" in p for p in problems)
