"""Experiment tracking (X3): the run's figures in TensorBoard, Weights & Biases and MLflow.

Beside ``metrics.jsonl`` and ``loss.png``, each destination is a ``FigureTracker`` that
writes the run's windows, intervals and evaluations as named scalars at a step. The
backends live one file each and import their library (the ``track`` extra) only when
asked for; only rank 0 writes, and nothing goes over a network unless the user asks.
Design and derivations: docs/design/tracking.md#trackinginitpy (X3, S5, S8, X4).
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
    directory that the refused start then removes (S8). A tracker that cannot start
    (its extra not installed, a directory that cannot be written) is a ``ConfigError``
    naming the ``log`` key, raised before the first window (X4)."""
    trackers: list[Tracker] = []
    try:
        if cfg.tensorboard:
            from exactstep.tracking.tensorboard import (  # lazy: a plug-in
                TENSORBOARD_DIR,
                TensorBoardTracker,
            )

            trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR, start=identity.start))
        if cfg.wandb != "off":
            from exactstep.tracking.wandb_run import WandbTracker  # lazy: a plug-in

            trackers.append(WandbTracker(run_dir, identity, mode=cfg.wandb,
                                         project=cfg.wandb_project))
        if cfg.mlflow:
            from exactstep.tracking.mlflow_run import MlflowTracker  # lazy: a plug-in

            trackers.append(MlflowTracker(cfg.mlflow, identity,
                                          experiment=cfg.mlflow_experiment))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers

