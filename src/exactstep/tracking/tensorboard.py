"""TensorBoard event files through ``torch.utils.tensorboard.SummaryWriter`` (X3).

``log.tensorboard = true`` writes them under ``RUN/tensorboard/``; on resume the writer
purges the events a killed run wrote after its last checkpoint (S5).
Design and derivations: docs/design/tracking.md#trackingtensorboardpy (X3, S5).
"""

from __future__ import annotations

from pathlib import Path

from exactstep.errors import ConfigError
from exactstep.tracking.base import FigureTracker

TENSORBOARD_DIR = "tensorboard"


class TensorBoardTracker(FigureTracker):
    """``log.tensorboard = true``: event files under ``RUN/tensorboard/``."""

    def __init__(self, log_dir: Path, *, start: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "log.tensorboard = true needs the tensorboard package; install the "
                "'track' extra (pip install 'exactstep[track]') or set log.tensorboard = false"
            ) from exc
        try:
            # purge_step: events at steps after the resumed checkpoint (the first step
            # this run writes is start + 1), written by the run that was stopped, are
            # hidden by TensorBoard; step ``start`` itself is the checkpoint's past
            self.writer = SummaryWriter(log_dir=str(log_dir),
                                        purge_step=start + 1 if start > 0 else None)
        except OSError as exc:
            raise ConfigError(f"log.tensorboard: cannot write {log_dir} ({exc.strerror or exc}); "
                              "choose a writable --out or set log.tensorboard = false") from exc

    def write(self, figures: dict[str, float], step: int) -> None:
        for tag, value in figures.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()
