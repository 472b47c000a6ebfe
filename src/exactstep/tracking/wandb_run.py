"""Weights & Biases (X3): the run's figures as W&B runs, offline or online.

``log.wandb = "offline"`` writes the run under ``RUN/wandb/`` (``wandb sync`` uploads it
later); ``"online"`` streams it. Each start of an exactstep run is one W&B run (a
segment), grouped by the run's identity; nothing about the machine is logged.
Design and derivations: docs/design/tracking.md#trackingwandb_runpy (X3, S5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exactstep.errors import ConfigError
from exactstep.tracking.base import FigureTracker, RunIdentity

WANDB_DIR = "wandb"


class WandbTracker(FigureTracker):
    """One W&B run per start, in ``mode`` ``offline`` or ``online``.

    Grouped by ``NAME-DIGEST12``, named ``NAME@START``, with the resolved configuration
    and ``exactstep.start_window`` / ``exactstep.manifest_digest`` as its config; system
    metrics, console capture, code and git snapshots are off. Raises ``ConfigError``
    when ``wandb`` is missing or cannot start a run.
    """

    def __init__(self, run_dir: Path, identity: RunIdentity, *, mode: str,
                 project: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError(
                f"log.wandb = {mode!r} needs the wandb package; install the 'track' extra "
                "(pip install 'exactstep[track]') or set log.wandb = \"off\"") from exc
        settings = wandb.Settings(silent=True, console="off", save_code=False,
                                  disable_git=True, disable_job_creation=True,
                                  x_disable_stats=True)
        config: dict[str, Any] = {**identity.config, "exactstep": {
            "start_window": identity.start, "manifest_digest": identity.digest,
            "run": identity.key}}
        try:
            self.run = wandb.init(mode=mode, dir=str(run_dir), project=project,
                                  group=identity.key, job_type="train",
                                  name=f"{identity.name}@{identity.start}", config=config,
                                  settings=settings, reinit="create_new")
        except Exception as exc:  # wandb raises its own error types (login, network, disk)
            raise ConfigError(f"log.wandb = {mode!r}: W&B could not start a run ({exc}); "
                              "set log.wandb = \"offline\" or \"off\"") from exc

    def write(self, figures: dict[str, float], step: int) -> None:
        self.run.log(figures, step=step)

    def close(self) -> None:
        self.run.finish()
