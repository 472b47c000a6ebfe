"""TensorBoard tracking (X3): what the event files hold, read back by TensorBoard's own
reader, against the run's ledger and metrics; resume hides what a stopped run wrote
after its checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from run_support import TINY, short_texts, write_texts

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (  # noqa: E402
    EventAccumulator,
)

from exactstep.config import load_config  # noqa: E402
from exactstep.errors import ConfigError  # noqa: E402
from exactstep.tracking.tensorboard import TensorBoardTracker  # noqa: E402
from exactstep.update.disposition import Disposition, Outcome  # noqa: E402


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard would show: tag -> {step: value} (purged events hidden)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    return float(np.float32(x))  # event files store scalars as float32


def test_a_run_writes_its_ledger_and_evaluations_to_tensorboard(tmp_path):
    from exactstep.run.runner import train

    source = write_texts(tmp_path / "docs.jsonl", short_texts())
    overrides = [f"{k}={v}" for k, v in TINY.items()] + [
        f"data.source={source}", "data.val_fraction=0.2", "train.steps=6", "train.eval_every=3",
        "train.log_every=2", "train.progress=false", "log.tensorboard=true",
        "update.warmup=2",
    ]
    out = tmp_path / "run"
    train(load_config(None, overrides), out, progress=False)
    seen = scalars(out / "tensorboard")
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    committed = [r for r in ledger if r["disposition"] == "COMMITTED"]
    assert len(committed) == 6
    assert seen["train/loss"] == {r["window"] + 1: f32(r["loss"]) for r in committed}
    assert seen["train/lr"] == {r["window"] + 1: f32(r["lr"]) for r in committed}
    assert seen["train/grad_norm"] == {r["window"] + 1: f32(r["grad_norm"]) for r in committed}
    assert seen["train/committed"] == {w: float(w) for w in range(1, 7)}
    assert seen["train/skipped_nonfinite"] == {w: 0.0 for w in range(1, 7)}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = {m["window"]: f32(m["eval_loss"]) for m in metrics if "eval_loss" in m}
    assert evals and seen["eval/loss"] == evals
    rates = {m["window"]: f32(m["tokens_per_s"]) for m in metrics if "tokens_per_s" in m}
    assert seen["train/tokens_per_s"] == rates and sorted(rates) == [2, 4, 6]


def committed(window: int, loss: float) -> Disposition:
    return Disposition(window=window, outcome=Outcome.COMMITTED, cause=None, lr=1e-3,
                       denominator=1.0, loss=loss, grad_norm=1.0, tokens=1)


def write(log_dir: Path, windows: range, loss: float, start: int, purge: bool = True) -> None:
    tracker = TensorBoardTracker(log_dir, start=start if purge else 0)
    counts = {o.value: 0 for o in Outcome}
    for w in windows:
        counts["COMMITTED"] += 1
        tracker.window(committed(w, loss), counts)
    tracker.close()


def test_a_resume_hides_what_the_stopped_run_wrote_after_its_checkpoint(tmp_path):
    """Run 1 reached window 6 and was killed; its last checkpoint is at window 3. The
    resumed tracker (start = 3) writes windows 4..6 again: TensorBoard must show run 1's
    1..3 and the resumed 4..6, never run 1's 4..6."""
    log_dir = tmp_path / "tb"
    write(log_dir, range(0, 6), loss=1.0, start=0)
    write(log_dir, range(3, 6), loss=2.0, start=3)
    assert scalars(log_dir)["train/loss"] == {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0, 6: 2.0}


def test_negative_control_without_purge_the_stale_events_stay(tmp_path):
    log_dir = tmp_path / "tb"
    write(log_dir, range(0, 6), loss=1.0, start=0)
    write(log_dir, range(3, 6), loss=2.0, start=3, purge=False)
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert steps != sorted(set(steps))  # windows 4..6 appear twice: the check can fail


def test_tensorboard_missing_is_one_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="log.tensorboard = true needs the tensorboard package"):
        TensorBoardTracker(tmp_path / "tb", start=0)


def test_loss_plot_marks_skipped_and_no_objective_windows(tmp_path, monkeypatch):
    """``loss.png`` (X3): a skipped and two no-objective windows appear as marks with
    their counts, at their windows; the committed curve leaves them out."""
    import matplotlib.pyplot as plt

    from exactstep.run.report import plot_loss

    lines = [{"window": 0, "disposition": "COMMITTED", "loss": 2.0},
             {"window": 1, "disposition": "SKIPPED_NONFINITE", "loss": None},
             {"window": 2, "disposition": "NO_OBJECTIVE", "loss": None},
             {"window": 3, "disposition": "COMMITTED", "loss": 1.5},
             {"window": 4, "disposition": "NO_OBJECTIVE", "loss": None}]
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (tmp_path / "metrics.jsonl").write_text("")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot_loss(tmp_path)
    (ax,) = figures[0].axes
    drawn = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert drawn["train (window S/D)"] == [0, 3]
    assert drawn["skipped (non-finite): 1"] == [1]
    assert drawn["no objective: 2"] == [2, 4]
    assert (tmp_path / "loss.png").stat().st_size > 0
