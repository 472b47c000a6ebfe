"""Experiment tracking (X3): the run's figures in TensorBoard, Weights & Biases and
MLflow, beside ``metrics.jsonl`` and ``loss.png``.

Each destination is a ``FigureTracker``: this package turns the run's windows,
intervals and evaluations into named scalars at a step, and each backend writes
them its own way (``tensorboard``, ``wandb_run``, ``mlflow_run``; each library is
in the ``track`` extra and imported only when asked for). Nothing is sent over a
network unless the user asks for it (``log.wandb = "online"``, or an ``http``
MLflow URI).

The figures, with the window count (``disposition.window + 1``, the same ``window``
as ``metrics.jsonl``) as the step:

- every window: ``train/committed``, ``train/skipped_nonfinite``,
  ``train/no_objective`` (cumulative outcome counts, so a skipped or no-objective
  window is visible as a step in its curve) and, for a committed window,
  ``train/loss`` (its S / D), ``train/gold_nll``, ``train/lr`` and
  ``train/grad_norm`` (before clipping);
- every ``train.log_every`` windows: ``train/tokens_per_s``;
- every evaluation: ``eval/loss``, ``eval/bits_per_byte``, ``eval/bits_per_token``
  and ``eval/perplexity`` where they are numbers.

Resume (S5, S8): a killed run may have written figures for windows after its last
checkpoint, which the resumed run recomputes. Each backend makes the resumed curve
the one that counts: TensorBoard purges them (``purge_step``); a Weights & Biases or
MLflow start is its own *segment* (one run of the library per start of the
exactstep run, all carrying the run's identity), and a segment that starts at
window ``s`` supersedes the earlier segments' figures after step ``s``
(``segment_curve`` is the rule). Only rank 0 writes. A tracker that cannot start
(the extra not installed, a directory that cannot be written) is a
``ConfigError`` naming the key, before the first window.
"""

from __future__ import annotations

from pathlib import Path

from exactstep.tracking.base import (
    FigureTracker,
    LogConfig,
    RunIdentity,
    Tracker,
    evaluation_figures,
    segment_curve,
    window_figures,
)

__all__ = ["FigureTracker", "LogConfig", "RunIdentity", "Tracker", "evaluation_figures", "segment_curve", "window_figures", "build_trackers"]


def build_trackers(cfg: LogConfig, run_dir: Path, identity: RunIdentity) -> list[Tracker]:
    """The trackers ``cfg`` asks for (rank 0 only calls this), opened at
    ``identity.start``. When one cannot start, those already started are closed
    before the error goes on, so nothing of theirs is still writing into the run
    directory that the refused start then removes (S8)."""
    trackers: list[Tracker] = []
    try:
        if cfg.tensorboard:
            from exactstep.tracking.tensorboard import TENSORBOARD_DIR, TensorBoardTracker

            trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR, start=identity.start))
        if cfg.wandb != "off":
            from exactstep.tracking.wandb_run import WandbTracker

            trackers.append(WandbTracker(run_dir, identity, mode=cfg.wandb,
                                         project=cfg.wandb_project))
        if cfg.mlflow:
            from exactstep.tracking.mlflow_run import MlflowTracker

            trackers.append(MlflowTracker(cfg.mlflow, identity,
                                          experiment=cfg.mlflow_experiment))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers

