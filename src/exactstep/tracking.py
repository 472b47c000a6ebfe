"""Experiment tracking (X3): the run's figures in TensorBoard, beside ``metrics.jsonl``.

``log.tensorboard = true`` writes TensorBoard event files under ``RUN/tensorboard/``
through ``torch.utils.tensorboard`` (the ``track`` extra installs ``tensorboard``).
Nothing is sent anywhere: the files are local and the user opens them with
``tensorboard --logdir RUN/tensorboard``.

What is written, with the window count (``disposition.window + 1``, the same
``window`` as ``metrics.jsonl``) as the global step:

- every window: ``train/committed``, ``train/skipped_nonfinite``,
  ``train/no_objective`` (cumulative outcome counts, so a skipped or no-objective
  window is visible as a step in its curve) and, for a committed window,
  ``train/loss`` (its S / D), ``train/gold_nll``, ``train/lr`` and
  ``train/grad_norm`` (before clipping);
- every ``train.log_every`` windows: ``train/tokens_per_s``;
- every evaluation: ``eval/loss``, ``eval/bits_per_byte``, ``eval/bits_per_token``
  and ``eval/perplexity`` where they are numbers.

Resume (S5, S8): a resumed run opens the writer with ``purge_step`` at the first
step it writes (``start + 1``), so TensorBoard hides the events a killed run wrote
after its last checkpoint; the curves continue as if the run had never stopped. Only rank 0
writes. A tracker that cannot start (the extra not installed, a directory that
cannot be written) is a ``ConfigError`` naming the key, before the first window.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from exactstep.errors import ConfigError
from exactstep.update.disposition import Disposition, Outcome

TENSORBOARD_DIR = "tensorboard"


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where a run's figures go besides ``metrics.jsonl`` and ``loss.png``.

    ``tensorboard``: write TensorBoard event files under ``RUN/tensorboard/``.
    """

    tensorboard: bool = False


class Tracker(Protocol):
    """One destination of a run's figures."""

    def window(self, disp: Disposition, counts: dict[str, int]) -> None: ...

    def interval(self, record: dict[str, Any]) -> None: ...

    def evaluation(self, window: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """TensorBoard event files through ``torch.utils.tensorboard.SummaryWriter``."""

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

    def window(self, disp: Disposition, counts: dict[str, int]) -> None:
        step = disp.window + 1
        add = self.writer.add_scalar
        for outcome in Outcome:
            add(f"train/{outcome.value.lower()}", counts[outcome.value], step)
        if disp.outcome is not Outcome.COMMITTED:
            return
        for name, value in (("loss", disp.loss), ("gold_nll", disp.gold_loss),
                            ("lr", disp.lr), ("grad_norm", disp.grad_norm)):
            if value is not None:
                add(f"train/{name}", value, step)

    def interval(self, record: dict[str, Any]) -> None:
        self.writer.add_scalar("train/tokens_per_s", record["tokens_per_s"], record["window"])

    def evaluation(self, window: int, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key.startswith("eval_") and isinstance(value, float):
                self.writer.add_scalar(f"eval/{key[len('eval_'):]}", value, window)

    def close(self) -> None:
        self.writer.close()


def build_trackers(cfg: LogConfig, run_dir: Path, *, start: int) -> list[Tracker]:
    """The trackers ``cfg`` asks for (rank 0 only calls this), opened at ``start``."""
    trackers: list[Tracker] = []
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(run_dir / TENSORBOARD_DIR, start=start))
    return trackers
