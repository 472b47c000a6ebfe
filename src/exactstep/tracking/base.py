"""The tracker base (X3): what every backend builds on, one file each.

The ``[log]`` section, the run's identity, the ``Tracker`` protocol every backend
honours, the figures a window or an evaluation becomes, and the rule
(``segment_curve``) that makes a resumed segment's curve the one that counts (S5).
Design and derivations: docs/design/tracking.md#trackingbasepy (X3, S1, S5).
"""


from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from exactstep.update.disposition import Disposition, Outcome


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where a run's figures go besides ``metrics.jsonl`` and ``loss.png``.

    ``tensorboard``: write TensorBoard event files under ``RUN/tensorboard/``.
    ``wandb``: ``offline`` writes a Weights & Biases run under ``RUN/wandb/`` (upload
    it later with ``wandb sync``); ``online`` streams it to the account the
    ``wandb`` login names; ``off``: neither. ``wandb_project``: its project.
    ``mlflow``: a directory (a local MLflow file store) or an MLflow tracking URI
    (``sqlite:///...``, ``http://...``); empty: off. ``mlflow_experiment``: the
    experiment the run's segments are logged under.
    """

    tensorboard: bool = False
    wandb: Literal["off", "offline", "online"] = "off"
    wandb_project: str = "exactstep"
    mlflow: str = ""
    mlflow_experiment: str = "exactstep"


@dataclass(frozen=True)
class RunIdentity:
    """What names one exactstep run in every tracker: its directory's name, the
    manifest digest (equal across the run's starts, S1), the resolved configuration
    and the window this start begins at."""

    name: str
    digest: str
    config: dict[str, Any]
    start: int

    @property
    def key(self) -> str:
        """The run's identity across starts: ``NAME-DIGEST12``."""
        return f"{self.name}-{self.digest[:12]}"


class Tracker(Protocol):
    """One destination of a run's figures."""

    def window(self, disp: Disposition, counts: dict[str, int]) -> None: ...

    def interval(self, record: dict[str, Any]) -> None: ...

    def evaluation(self, window: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def window_figures(disp: Disposition, counts: dict[str, int]) -> dict[str, float]:
    """The scalars of one finished window: the cumulative outcome counts
    ``train/committed``, ``train/skipped_nonfinite``, ``train/no_objective`` and, for a
    committed window, ``train/loss`` (S / D), ``train/gold_nll``, ``train/lr`` and
    ``train/grad_norm`` (before clipping). Written at step ``disp.window + 1``."""
    figures = {f"train/{outcome.value.lower()}": float(counts[outcome.value])
               for outcome in Outcome}
    if disp.outcome is Outcome.COMMITTED:
        for name, value in (("loss", disp.loss), ("gold_nll", disp.gold_loss),
                            ("lr", disp.lr), ("grad_norm", disp.grad_norm)):
            if value is not None:
                figures[f"train/{name}"] = float(value)
    return figures


def evaluation_figures(record: dict[str, Any]) -> dict[str, float]:
    """``eval/NAME`` for every numeric ``eval_NAME`` of a held-out record."""
    return {f"eval/{key[len('eval_'):]}": value for key, value in record.items()
            if key.startswith("eval_") and isinstance(value, float)}


class FigureTracker:
    """A ``Tracker`` that writes named scalars at a step; backends define ``write``."""

    def write(self, figures: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def window(self, disp: Disposition, counts: dict[str, int]) -> None:
        self.write(window_figures(disp, counts), disp.window + 1)

    def interval(self, record: dict[str, Any]) -> None:
        self.write({"train/tokens_per_s": float(record["tokens_per_s"])}, record["window"])

    def evaluation(self, window: int, record: dict[str, Any]) -> None:
        figures = evaluation_figures(record)
        if figures:
            self.write(figures, window)

    def close(self) -> None:
        pass


def segment_curve(segments: list[tuple[int, dict[int, float]]]) -> dict[int, float]:
    """One figure's curve across a run's segments ``(start window, {step: value})``,
    given in the order they were started: each segment keeps what the earlier ones
    wrote up to its start and replaces everything after it (a resume recomputes the
    windows after its checkpoint; a resume from an older checkpoint rewinds further)."""
    curve: dict[int, float] = {}
    for start, points in segments:
        curve = {k: v for k, v in curve.items() if k <= start}
        curve.update({k: v for k, v in points.items() if k > start})
    return curve
