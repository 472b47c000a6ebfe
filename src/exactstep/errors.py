"""The one exception hierarchy of exactstep (X4).

Every failure a user can cause is an ``ExactstepError`` subclass whose message says
what to change. The CLI prints ``error: <message>`` on one line and exits non-zero;
anything that is not an ``ExactstepError`` is a bug and keeps its traceback.
"""

from __future__ import annotations

# The second way to continue a stopped run, named by every "continue with" hint: the
# command a launcher's restart or a requeued job runs again (S10).
RESUME_AUTO_HINT = "or the same train command with --resume auto"


class ExactstepError(Exception):
    """Base of every user-facing error. The message names what the user must change."""

    exit_code: int = 2


class ConfigError(ExactstepError):
    """A configuration key or value is unknown or invalid."""


class MissingSectionError(ConfigError):
    """The configuration handed to a stage lacks a section it reads; names the key. No
    default stands in for a section the run did not bring."""

    def __init__(self, key: str, kind: str) -> None:
        super().__init__(f"the configuration has no [{key}] section ({kind}); pass the run's "
                         f"RunConfig, which always carries one")
        self.key = key


class DataError(ExactstepError):
    """A data source is missing, malformed, or empty."""


class BatchInvariantError(DataError):
    """A compiled batch violates an R7 invariant; the message names the example."""


class ObjectiveError(ExactstepError):
    """An objective setting is invalid (e.g. smoothing convention needing V >= 3)."""


class RewardError(ObjectiveError):
    """A declared reward function raised, or returned something other than one finite
    number (Q2); the message names the window, example and sample."""


class ModelError(ExactstepError):
    """A model setting cannot be realised (e.g. FlexAttention backward on CPU)."""


class CheckpointError(ExactstepError):
    """A checkpoint is missing, incomplete, or corrupted; the message names the file."""


class ResumeError(ExactstepError):
    """A resume was refused (e.g. manifest differs); the message names the fields."""


class DistributedError(ExactstepError):
    """A distributed setting or world-size change cannot be honoured."""


class Interrupted(ExactstepError):
    """Training stopped on a signal after publishing a checkpoint; says how to resume."""

    exit_code = 130


class StorageError(ExactstepError):
    """A file could not be written (disk full, quota, read-only); nothing committed was lost."""


class ExportError(ExactstepError):
    """An export could not be written or failed its handoff check (H3); nothing was published."""


class DirectoryInUse(ExactstepError):
    """Another process holds the lock of a run directory (or a ``prepare`` or ``export``
    output); the message names its PID. Nothing was touched: run the command again once
    that process has ended. Exit code 75 (``EX_TEMPFAIL``: try again later)."""

    exit_code = 75
