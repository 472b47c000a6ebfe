"""Resume: the manifest check (S4), the choice of checkpoint with recovery (S6, S8),
the journals check, and stop signals.

Between a run directory on disk and the runner's restore: which verified checkpoint
a resume starts from, whether the manifest and the journals still match it, and how
a SIGTERM / SIGINT becomes a clean stop at a window boundary.
Design and derivations: docs/design/state.md#stateresumepy (S4, S6, S8).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from exactstep.errors import CheckpointError, ResumeError
from exactstep.state.durable import check_mark
from exactstep.state.manifest import Manifest, diff_manifests
from exactstep.state.store import (
    QUARANTINE,
    latest_checkpoint,
    published_checkpoints,
    verify_checkpoint,
)


def require_same_manifest(saved: Manifest, current: Manifest) -> None:
    """An exact resume needs the run's own manifest (S4); else ``ResumeError`` naming
    each differing dotted field."""
    if saved.digest == current.digest:
        return
    differing = diff_manifests(saved, current)
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


@dataclass(frozen=True)
class ResumePoint:
    """Where a resume starts: ``path`` (``None``: no checkpoint was ever published, so
    window 0) and ``note``, what the user must be told about how it was chosen."""

    path: Path | None
    note: str | None = None


def choose_resume_point(root: Path, from_path: Path | None = None) -> ResumePoint:
    """Choose and verify the checkpoint a resume starts from (S3, S6, S8).

    ``from_path`` when given; else the one ``LATEST`` names; a missing, garbage or
    dangling ``LATEST`` is recovered by taking the newest checkpoint that verifies,
    and ``note`` says so. No checkpoint ever published: ``path`` is ``None`` (window 0).
    Nothing on disk changes here.

    Raises ``CheckpointError`` naming the damaged files (and the newest earlier
    checkpoint that verifies, if any) when the chosen checkpoint fails verification,
    or when checkpoints exist but none verifies.
    """
    root = Path(root)
    if from_path is not None:
        return ResumePoint(_verified(root, Path(from_path)))
    try:
        latest = latest_checkpoint(root)
        why = "checkpoints/LATEST is missing" if latest is None else None
    except CheckpointError as exc:
        latest, why = None, str(exc).split(";")[0]
    if latest is not None:
        return ResumePoint(_verified(root, latest))
    skipped: list[str] = []
    for path in reversed(published_checkpoints(root)):
        report = verify_checkpoint(path)
        if report.ok:
            note = f"{why}; resuming from {path.name}, the newest checkpoint that verifies"
            if skipped:
                note += f" (skipped: {'; '.join(skipped)})"
            return ResumePoint(path, note)
        skipped.append(f"{path.name}: {report.summary()}")
    leftovers = _checkpoint_like(root)
    if leftovers:
        raise CheckpointError(
            f"{why} and no checkpoint in {root} verifies ({'; '.join(skipped) or ', '.join(leftovers) + ' have no readable manifest'}); "
            "nothing was changed; repair one, or start a new run with a new --out"
        )
    return ResumePoint(None, "no checkpoint was published yet; starting again from window 0 "
                             "under the run's manifest")


def _verified(root: Path, path: Path) -> Path:
    report = verify_checkpoint(path)
    if report.ok:
        return path
    earlier = next(
        (p for p in reversed(published_checkpoints(root))
         if p.name != path.name and verify_checkpoint(p).ok), None)
    hint = (f"resume from an earlier checkpoint with --from {earlier}" if earlier
            else "no other checkpoint verifies; start a new run")
    raise CheckpointError(f"checkpoint {path} failed verification: {report.summary()}; {hint}")


def _checkpoint_like(root: Path) -> list[str]:
    """Visible directories under ``root`` other than the quarantine (maybe checkpoints)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and p.name != QUARANTINE)


def check_journals(run_dir: Path, marks: Mapping[str, dict[str, Any]], checkpoint: Path,
                   *, marks_of: Callable[[Path], dict[str, dict[str, Any]] | None]) -> None:
    """Every journal must begin with the prefix the checkpoint recorded (S8).

    ``marks`` maps a journal's file name to its recorded mark; a journal written
    further is fine (the tail after the checkpoint is dropped on resume). A journal
    that lost or changed recorded lines raises ``ResumeError`` naming it, with the
    newest earlier checkpoint whose record still holds (``marks_of`` reads a
    checkpoint's marks) as the way forward.
    """
    for filename, mark in marks.items():
        problem = check_mark(Path(run_dir) / filename, mark)
        if problem is None:
            continue
        fallback = _earlier_matching(run_dir, checkpoint, marks_of)
        hint = (f"resume from {fallback} with --from, whose record still matches" if fallback
                else "restore the file from a copy, or start a new run with --warm-start")
        raise ResumeError(f"{Path(run_dir) / filename} does not match checkpoint "
                          f"{checkpoint.name}: {problem}; nothing was changed; {hint}")


def _earlier_matching(run_dir: Path, chosen: Path,
                      marks_of: Callable[[Path], dict[str, dict[str, Any]] | None]) -> Path | None:
    published = published_checkpoints(chosen.parent)
    names = [p.name for p in published]
    earlier = published[: names.index(chosen.name)] if chosen.name in names else []
    for path in reversed(earlier):
        marks = marks_of(path)
        if marks is not None and all(check_mark(Path(run_dir) / f, m) is None
                                     for f, m in marks.items()):
            return path
    return None


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
