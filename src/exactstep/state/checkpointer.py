"""The Checkpointer: what the runner calls to save and restore a run's state (S2, S7).

Built once per run over everything S2 names (model, update engine, row stream,
journals, manifest digest), it writes the one-process format or the multi-rank
format it is given, and restores either, a migration only with ``reshard`` (S7).
Design and derivations: docs/design/state.md#statecheckpointerpy (S2, S7, S9).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from exactstep.errors import RESUME_AUTO_HINT, CheckpointError, DistributedError, StorageError
from exactstep.state.durable import Journal
from exactstep.state.manifest import Manifest
from exactstep.state.rng import capture_rng, restore_rng
from exactstep.state.safetensors_format import (
    FORMAT,
    load_checkpoint,
    publish_checkpoint,
    read_part,
)
from exactstep.state.store import checkpoint_format, read_latest_name

# Checkpoint part names (what ``checkpoint verify`` reports) for the engine's state keys.
ENGINE_PARTS = {"optimizer": "optimizer", "schedule": "scheduler", "precision": "scaler",
                "counters": "counters", "program": "program"}  # program: a window program's


class Context(Protocol):
    rank: int
    world_size: int
    distributed: bool
    is_main: bool


class Engine(Protocol):
    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Stream(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class MultiRankFormat(Protocol):
    """What a multi-rank checkpoint format offers (``parallel.dcp_format.DcpFormat``).

    The runner hands one in; ``state`` never imports ``parallel`` (which builds on
    ``state.store``), so the packages do not import each other.
    """

    format: str

    def save(self, root: Path, name: str, *, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, common: dict[str, Any],
             rank_state: dict[str, Any], keep: int) -> Path: ...
    def load(self, path: Path, *, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer | None, reshard: bool) -> Any: ...
    def read_progress(self, path: Path) -> dict[str, Any]: ...
    def reshard_stream_state(self, old_data: list[Any], fresh: dict[str, Any]) -> dict: ...
    def reshard_record(self, old_world: int, new_world: int, old_data: list[Any]) -> dict: ...


@dataclass(frozen=True)
class Restored:
    """Where a restored run continues: ``next_window``, the journal marks the
    checkpoint recorded (file name -> mark), and ledger events (a RESHARD record)."""

    next_window: int
    progress: dict[str, Any]
    journals: dict[str, dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_name(next_window: int) -> str:
    return f"window-{next_window:08d}"


class Checkpointer:
    """``save(next_window)`` publishes S2 state; ``restore(path)`` loads it back.

    Build one per run. One process writes the safetensors format; a distributed
    ``ctx`` needs the ``multi_rank`` format it writes through (``ValueError``
    otherwise). ``environment`` (S9) is recorded with each checkpoint.
    """

    def __init__(self, root: Path, *, keep: int, model: torch.nn.Module, engine: Engine,
                 stream: Stream, ctx: Context, manifest_digest: str,
                 journals: dict[str, Journal] | None = None,
                 multi_rank: MultiRankFormat | None = None,
                 environment: dict[str, Any] | None = None) -> None:
        if ctx.distributed and multi_rank is None:
            raise ValueError("a multi-rank job needs a multi-rank checkpoint format")
        self.root = Path(root)
        self.keep = keep
        self.model = model
        self.engine = engine
        self.stream = stream
        self.ctx = ctx
        self.manifest_digest = manifest_digest
        self.journals = journals or {}
        self.multi_rank = multi_rank
        self.environment = environment  # recorded with each checkpoint (S9)

    # ------------------------------------------------------------------ save

    def save(self, next_window: int) -> Path:
        """Publish the state after ``next_window`` windows as ``window-<n>`` (S2, S3).

        Journals are fsynced first, so the marks recorded are on disk. A failed write
        raises ``StorageError`` saying the previous checkpoint is intact.
        """
        for journal in self.journals.values():
            journal.sync()
        name = checkpoint_name(next_window)
        engine_state = self.engine.state_dict()
        parts = {ENGINE_PARTS[k]: v for k, v in engine_state.items()}
        parts["progress"] = {
            "next_window": next_window,
            "manifest_digest": self.manifest_digest,
            "journals": {Path(j.path).name: j.mark() for j in self.journals.values()},
            "environment": self.environment,
        }
        try:
            if self.ctx.distributed:
                assert self.multi_rank is not None
                parts.pop("optimizer")
                return self.multi_rank.save(
                    self.root, name, model=self.model, optimizer=self.engine.optimizer,
                    common=parts, rank_state={"rng": capture_rng(),
                                              "data": self.stream.state_dict()},
                    keep=self.keep)
            parts["rng"] = capture_rng()
            parts["data"] = self.stream.state_dict()
            model_state = checkpoint_model_state(self.model)
            return publish_checkpoint(self.root, name, model_state, parts, keep=self.keep)
        except StorageError as exc:
            raise StorageError(f"{exc}; free space and continue with: exactstep resume "
                               f"{self.root.parent}, {RESUME_AUTO_HINT}") from None

    @contextmanager
    def guard_writes(self) -> Iterator[None]:
        """Inside, a failed write to the run directory (disk full, quota) becomes one
        ``StorageError`` that names the file and the checkpoint that is intact."""
        try:
            yield
        except OSError as exc:
            try:
                latest = read_latest_name(self.root)
            except CheckpointError:
                latest = None
            kept = f"checkpoint {latest} is intact" if latest else "no checkpoint was published yet"
            raise StorageError(
                f"writing {exc.filename or self.root.parent} failed ({exc.strerror or exc}); "
                f"{kept}; free space and continue with: exactstep resume {self.root.parent}, "
                f"{RESUME_AUTO_HINT}"
            ) from None

    # ------------------------------------------------------------------ restore

    def restore(self, path: Path, *, reshard: bool = False) -> Restored:
        """Load a verified checkpoint into the model, engine, stream and RNG (S2, S7).

        The checkpoint's own format decides the loader: a multi-rank checkpoint
        loads through DCP even into one process, and a one-process checkpoint into
        several ranks; either migration needs ``reshard``.
        """
        if checkpoint_format(path) != FORMAT:
            return self._restore_multi_rank(path, reshard)
        if self.ctx.world_size != 1 and not reshard:
            raise DistributedError(
                f"checkpoint {path.name} was written by 1 process but this job has "
                f"{self.ctx.world_size}; relaunch with 1 process, or pass --reshard"
            )
        model_state, parts = load_checkpoint(path)
        load_model_state(self.model, model_state)
        self.engine.load_state_dict({k: parts[name] for k, name in ENGINE_PARTS.items()
                                     if name in parts})
        restore_rng(parts["rng"])
        events = []
        if self.ctx.world_size == 1:
            self.stream.load_state_dict(parts["data"])
        else:
            assert self.multi_rank is not None
            fresh = self.stream.state_dict()
            self.stream.load_state_dict(self.multi_rank.reshard_stream_state([parts["data"]],
                                                                             fresh))
            events.append(self.multi_rank.reshard_record(1, self.ctx.world_size,
                                                         [parts["data"]]))
        return _restored(parts["progress"], events)

    def _restore_multi_rank(self, path: Path, reshard: bool) -> Restored:
        multi_rank = self._multi_rank_format()
        state = multi_rank.load(path, model=self.model, optimizer=self.engine.optimizer,
                                reshard=reshard)
        common = state.common
        engine_state = {k: common[name] for k, name in ENGINE_PARTS.items()
                        if name != "optimizer" and name in common}
        engine_state["optimizer"] = self.engine.optimizer.state_dict()  # loaded by DCP above
        self.engine.load_state_dict(engine_state)
        events = []
        if state.reshard is None:
            self.stream.load_state_dict(state.rank_state["data"])
        else:
            fresh = self.stream.state_dict()
            self.stream.load_state_dict(multi_rank.reshard_stream_state(state.old_data, fresh))
            events.append(state.reshard)
        restore_rng(state.rank_state["rng"])
        return _restored(common["progress"], events)

    def journal_marks(self, path: Path) -> dict[str, dict[str, Any]] | None:
        """The journal marks a checkpoint recorded, or ``None`` if it cannot be read."""
        try:
            progress = checkpoint_progress(path, self.multi_rank)
        except (CheckpointError, DistributedError):
            return None
        return dict(progress.get("journals", {}))

    def _multi_rank_format(self) -> MultiRankFormat:
        if self.multi_rank is None:
            raise DistributedError("this checkpoint was written by several ranks; resume it "
                                   "with --reshard (or under torchrun)")
        return self.multi_rank


def checkpoint_progress(path: Path, multi_rank: MultiRankFormat | None) -> dict[str, Any]:
    """A checkpoint's verified progress part (window, journal marks, manifest digest,
    numerics environment), in either format; ``multi_rank`` reads a multi-rank one."""
    if checkpoint_format(path) == FORMAT:
        return read_part(path, "progress")
    if multi_rank is None:
        raise DistributedError(f"{path} is a multi-rank checkpoint; no reader for it was given")
    return multi_rank.read_progress(path)


def recorded_environment(checkpoint: Path | None, manifest: Manifest,
                         multi_rank: MultiRankFormat | None) -> dict[str, Any] | None:
    """The numerics environment a run continues from (S9): the checkpoint's own
    record, or the manifest's (the run's start) when there is no checkpoint yet;
    ``None`` for a run written before environments were recorded."""
    if checkpoint is not None:
        recorded = checkpoint_progress(checkpoint, multi_rank).get("environment")
    else:
        recorded = manifest.to_dict().get("environment")
    return dict(recorded) if recorded else None


def _restored(progress: dict[str, Any], events: list[dict[str, Any]]) -> Restored:
    journals = dict(progress.get("journals", {}))
    return Restored(int(progress["next_window"]), progress, journals, events)


def checkpoint_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a one-process checkpoint holds of ``model``: its ``checkpoint_state()``
    where it has one (with LoRA, the adapters only: H4), else its whole state dict."""
    own = getattr(model, "checkpoint_state", None)
    state = own() if callable(own) else model.state_dict()
    return {k: v.detach().cpu() for k, v in state.items()}


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what ``checkpoint_model_state`` saved (``load_checkpoint_state`` where the
    model has one)."""
    own = getattr(model, "load_checkpoint_state", None)
    if callable(own):
        own(state)
    else:
        model.load_state_dict(state)


def load_weights(path: Path, model: torch.nn.Module,
                 multi_rank: MultiRankFormat | None = None) -> None:
    """Load only a checkpoint's weights into ``model`` (evaluation, warm start, E1)."""
    if checkpoint_format(path) == FORMAT:
        load_model_state(model, load_checkpoint(path)[0])
        return
    if multi_rank is None:
        raise DistributedError(f"{path} is a multi-rank checkpoint; no loader for it was given")
    multi_rank.load(path, model=model, optimizer=None, reshard=True)
