"""Held-out numbers a run reports, against an independent evaluation (L5, E1, X3).

One tiny run (6 windows, ``train.eval_every = 2``, a checkpoint published at every
evaluation) is trained through the command line. Every held-out figure it writes,
``summary.json``, ``exactstep eval`` and the mid-run ``metrics.jsonl`` lines, must
equal a plain-PyTorch evaluation written here: the checkpoint's weights loaded into
the model, each validation document run alone, cross entropy over its shifted
targets, sums reduced before dividing (within twice the independent evaluation's own
fp32 distance from the same evaluation in float64, at least twice the rounding of the
mean itself: ``spread_bound``). Negative controls: averaging
per-batch (or per-document) means is a different number that fails the same check,
and each mid-run line matches only the checkpoint of its own window.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from equivalence import spread_bound
from run_support import (
    TINY,
    global_mean,
    heldout_per_document,
    set_args,
    short_texts,
    val_documents,
    write_texts,
)

from exactstep import Example, eval_batches
from exactstep.cli import main
from exactstep.rows.config import BatchConfig
from exactstep.run.finished_run import evaluate_run
from exactstep.state import latest_checkpoint, load_checkpoint

pytestmark = pytest.mark.slow

STEPS, EVAL_EVERY, VAL_FRACTION = 6, 2, 0.25


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout")
    source = write_texts(root / "short.jsonl", short_texts(60))
    settings = {
        "seed": 2, "data.source": source, "data.val_fraction": VAL_FRACTION, **TINY,
        "update.warmup": 2, "update.lr": 0.02, "train.steps": STEPS,
        "train.eval_every": EVAL_EVERY, "checkpoint.every": EVAL_EVERY, "checkpoint.keep": 5,
        "train.eval_tokens": 10**6,  # above the split's size: every target is scored
    }
    out = root / "run"
    assert main(["train", "--no-progress", "--out", str(out), *set_args(settings)]) == 0
    docs = val_documents(source, VAL_FRACTION)
    assert docs and all(len(d) <= TINY["batch.seq_len"] for d in docs)  # none is split
    return out, docs


def independent(run_dir, docs, name: str | None = None) -> tuple[float, int, list, float]:
    """The independent held-out loss, its target count, the per-document sums, and the
    tolerance: ``spread_bound`` of the loss against the same evaluation in float64."""
    checkpoints = run_dir / "checkpoints"
    path = checkpoints / name if name else latest_checkpoint(checkpoints)
    model_state, _ = load_checkpoint(path)
    per_doc = heldout_per_document(model_state, docs)
    loss, count = global_mean(per_doc)
    exact, _ = global_mean(heldout_per_document(model_state, docs, exact=True))
    return loss, count, per_doc, spread_bound(torch.tensor(loss), torch.tensor(exact))


def per_batch_mean(docs, per_doc) -> float:
    """WRONG (L5): the mean of each held-out batch's own mean."""
    examples = [Example(i, np.array(d, dtype=np.int64)) for i, d in enumerate(docs)]
    cfg = BatchConfig(seq_len=TINY["batch.seq_len"], rows=TINY["batch.rows"])
    means = []
    for batch in eval_batches(examples, cfg, pad_id=258):
        ids = [seg.example_id for row in batch.segments for seg in row]
        means.append(sum(per_doc[i][0] for i in ids) / sum(per_doc[i][1] for i in ids))
    assert len(means) > 1
    return sum(means) / len(means)


def per_document_mean(per_doc) -> float:
    """WRONG (L5): the mean of each document's own mean."""
    return sum(s / n for s, n in per_doc) / len(per_doc)


def test_summary_heldout_loss_and_tokens_equal_an_independent_evaluation(run) -> None:
    run_dir, docs = run
    summary = json.loads((run_dir / "summary.json").read_text())
    loss, count, per_doc, tol = independent(run_dir, docs)
    assert summary["heldout_tokens"] == count == sum(len(d) - 1 for d in docs)
    assert summary["heldout_loss"] == pytest.approx(loss, abs=tol)
    # exp and / log 2 carry the loss's error (relatively, absolutely) and round once more
    assert summary["heldout_perplexity"] == pytest.approx(math.exp(loss), rel=2 * tol)
    assert summary["heldout_bits_per_byte"] == pytest.approx(loss / math.log(2), abs=2 * tol)
    # negative controls: the wrong aggregations are other numbers, outside the tolerance
    for wrong in (per_batch_mean(docs, per_doc), per_document_mean(per_doc)):
        assert summary["heldout_loss"] != pytest.approx(wrong, abs=tol)


def test_eval_command_equals_an_independent_evaluation(run, capsys) -> None:
    run_dir, docs = run
    loss, count, _, tol = independent(run_dir, docs)
    report = evaluate_run(run_dir)
    assert report.checkpoint == f"window-{STEPS:08d}"
    assert report.result.tokens == count
    assert report.result.loss == pytest.approx(loss, abs=tol)
    # the command prints the same figures (to its 4 decimals)
    assert main(["eval", str(run_dir)]) == 0
    printed = re.search(r"held-out loss (\d+\.\d+) over (\d+) targets", capsys.readouterr().out)
    assert printed and printed[1] == f"{loss:.4f}" and int(printed[2]) == count
    # --from evaluates the named checkpoint, not the latest
    early, _, _, early_tol = independent(run_dir, docs, f"window-{EVAL_EVERY:08d}")
    chosen = evaluate_run(run_dir, from_checkpoint=run_dir / "checkpoints" / f"window-{EVAL_EVERY:08d}")
    assert chosen.result.loss == pytest.approx(early, abs=early_tol)
    assert abs(early - loss) > 1e-3  # the two checkpoints are distinguishable


def test_mid_run_evaluations_equal_the_checkpoint_of_their_window(run) -> None:
    """``train.eval_every``: one line at each multiple before the end (the end's own
    evaluation is the summary), each equal to an independent evaluation of the
    checkpoint published at that window."""
    run_dir, docs = run
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in lines if "eval_loss" in r]
    assert [r["window"] for r in evals] == list(range(EVAL_EVERY, STEPS, EVAL_EVERY))
    expected = {r["window"]: independent(run_dir, docs, f"window-{r['window']:08d}")
                for r in evals}
    for record in evals:
        loss, count, _, tol = expected[record["window"]]
        assert record["eval_tokens"] == count
        assert record["eval_loss"] == pytest.approx(loss, abs=tol)
        assert record["eval_bits_per_byte"] == pytest.approx(loss / math.log(2), abs=2 * tol)
        assert record["eval_perplexity"] == pytest.approx(math.exp(loss), rel=2 * tol)
        # negative control: the line does not match any other window's checkpoint
        for window, (other, *_) in expected.items():
            if window != record["window"]:
                assert record["eval_loss"] != pytest.approx(other, abs=tol)
