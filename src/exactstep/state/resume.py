"""Resume classification (S4), checkpoint choice with fallback (S6), stop signals.

* ``classify_resume(saved, current, warm_start=...)``: the same manifest digest is an
  exact resume; a different one is refused with every differing field named, unless
  the user asked for a warm start (weights only, counters reset, a new run).
* ``choose_checkpoint(root, from_path)``: the checkpoint a resume starts from,
  verified first; a damaged one is refused naming the file and the previous
  committed checkpoint to fall back to.
* ``StopRequest``: a context manager turning SIGTERM / SIGINT into a flag that the
  training loop reads at window boundaries, so it can publish a checkpoint and exit
  cleanly. A second signal of the same kind restores the default behaviour (a
  second Ctrl-C interrupts at once).
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from exactstep.errors import CheckpointError, ResumeError
from exactstep.manifest import Manifest, diff_manifests
from exactstep.state.checkpoint import latest_checkpoint, list_checkpoints, verify_checkpoint


class ResumeKind(Enum):
    EXACT = "exact"
    WARM_START = "warm_start"


@dataclass(frozen=True)
class ResumePlan:
    """How a resume proceeds; ``differing`` lists manifest fields that changed."""

    kind: ResumeKind
    differing: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.kind is ResumeKind.EXACT


def classify_resume(saved: Manifest, current: Manifest, *, warm_start: bool = False) -> ResumePlan:
    """Decide exact resume vs warm start vs refusal (S4).

    Equal digests: ``EXACT`` (even when ``warm_start`` is asked: there is nothing to
    migrate, but a caller that insists may still start a new run). Different
    digests: ``WARM_START`` if ``warm_start``, else ``ResumeError`` naming each
    differing dotted field.
    """
    if saved.digest == current.digest:
        return ResumePlan(ResumeKind.WARM_START if warm_start else ResumeKind.EXACT)
    differing = diff_manifests(saved, current)
    if warm_start:
        return ResumePlan(ResumeKind.WARM_START, differing)
    raise ResumeError(
        "the run's manifest differs from the resumed configuration in: "
        f"{', '.join(differing) or '(digest only)'}; resume with the original settings, "
        "or use --warm-start to start a new run from these weights"
    )


def check_progress_digest(progress: dict[str, Any], manifest: Manifest, path: Path) -> None:
    """A checkpoint's ``progress.manifest_digest`` must be the run's manifest digest (S2)."""
    recorded = progress.get("manifest_digest")
    if recorded != manifest.digest:
        raise ResumeError(
            f"checkpoint {path} was written under manifest {str(recorded)[:12]}, not this run's "
            f"{manifest.digest[:12]}; resume the run it belongs to, or use --warm-start"
        )


def choose_checkpoint(root: Path, from_path: Path | None = None) -> Path:
    """The verified checkpoint a resume starts from: ``from_path`` or ``LATEST`` (S3, S6).

    Raises ``ResumeError`` when nothing was published, and ``CheckpointError`` naming
    the damaged files (and the previous committed checkpoint, if any) when
    verification fails.
    """
    root = Path(root)
    path = Path(from_path) if from_path is not None else latest_checkpoint(root)
    if path is None:
        raise ResumeError(f"{root} holds no published checkpoint; start a new run with train")
    report = verify_checkpoint(path)
    if report.ok:
        return path
    problems = [f"{p.file} is {p.status}" for p in report.parts if p.status != "ok"]
    problems += report.problems
    earlier = [p for p in list_checkpoints(root) if p.name != path.name]
    hint = (
        f"resume from an earlier checkpoint with --from {earlier[-1]}"
        if earlier
        else "no earlier committed checkpoint exists; start a new run"
    )
    raise CheckpointError(f"checkpoint {path} failed verification: {'; '.join(problems)}; {hint}")


class StopRequest:
    """Turn SIGTERM and SIGINT into a flag read at window boundaries.

    Inside ``with StopRequest() as stop:`` the first SIGTERM/SIGINT sets
    ``stop.requested`` and ``stop.signal_name`` and otherwise lets the current window
    finish; a second signal of the same kind gets the default behaviour (SIGINT
    raises ``KeyboardInterrupt``, SIGTERM terminates). Previous handlers are restored
    on exit. Outside the main thread signals cannot be caught: the flag then stays
    unset and nothing is installed.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.signal_name == signal.Signals(signum).name:
            signal.signal(signum, signal.SIG_DFL)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name
