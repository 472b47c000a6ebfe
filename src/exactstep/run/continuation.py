"""Continuing a run: everything that continues, restarts or refuses one (S4, S7-S10).

``exactstep resume`` (an exact continuation, a declared reshard or a warm start),
``train --resume auto`` (the same command run again), the lost-checkpoint refusal,
the numerics-environment check (S9) and reopening the journals at the checkpoint's
marks. It builds the run and drives its windows through ``runner``.
Design and derivations: docs/design/run.md#runcontinuationpy (S4, S7, S8, S9, S10).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from exactstep.config import RunConfig, apply_overrides, config_from_manifest
from exactstep.errors import CheckpointError, DistributedError, ResumeError
from exactstep.model.decoder import model_note
from exactstep.parallel.dcp_format import DcpFormat
from exactstep.parallel.process_group import launcher_values, shutdown
from exactstep.parallel.storage import check_shared_run_dir, hold_run_dir
from exactstep.run.report import LEDGER_FILE, METRICS_FILE, ROLLOUTS_FILE
from exactstep.run.runner import (
    Run,
    announce,
    attach,
    build_run,
    finish,
    run_windows,
    start_journals,
    train,
    train_new,
)
from exactstep.state import environment
from exactstep.state.checkpointer import (
    checkpoint_progress,
    load_weights,
    recorded_environment,
)
from exactstep.state.durable import Journal
from exactstep.state.manifest import (
    MANIFEST_FILE,
    MODEL_AXIS_KEYS,
    Manifest,
    diff_manifests,
    read_manifest,
)
from exactstep.state.resume import (
    check_journals,
    check_progress_digest,
    choose_resume_point,
    require_same_manifest,
)
from exactstep.state.store import clean_uncommitted, verify_checkpoint
from exactstep.update.ledger import Ledger


def resume(
    run_dir: Path,
    *,
    from_checkpoint: Path | None = None,
    overrides: Sequence[str] = (),
    warm_start_dir: Path | None = None,
    reshard: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Continue ``run_dir`` exactly (S4), or warm-start a new run from its weights.

    Every check (manifest, checkpoint choice and verification, journals) runs before
    anything on disk changes (S8). The numerics environment the checkpoint recorded
    is restored (its thread count, ``train.compile`` and ``numerics.flush_denormal``,
    unless overridden); what
    cannot be restored makes the resume a declared, non-bitwise continuation: one
    line, and a CONTINUATION line in the ledger (S9). A different world size is a
    declared migration (S7): refused unless ``reshard``, which keeps the run's
    manifest, re-partitions the data cursor and records a RESHARD line in the ledger.
    """
    started = time.perf_counter()
    old = read_run_manifest(run_dir)
    cfg = apply_overrides(config_from_manifest(old), overrides)
    if warm_start_dir is not None:
        return warm_start(run_dir, old, cfg, warm_start_dir, from_checkpoint, progress)
    with hold_run_dir(run_dir, "run directory"):  # before a checkpoint is chosen (S8)
        return continue_run(run_dir, old, cfg, overrides, from_checkpoint, reshard, progress,
                            started)


def read_run_manifest(run_dir: Path) -> Manifest:
    """``read_manifest``; a rank other than 0 of a job that finds none is told that its
    run directory is probably not rank 0's (node-local storage, D1) and what to do."""
    try:
        return read_manifest(run_dir)
    except ResumeError as exc:
        values = launcher_values(os.environ)
        if values is None or values[0] == 0:
            raise
        import socket  # lazy: only to name this host in the message

        raise DistributedError(
            f"rank {values[0]} of {values[1]} on {socket.gethostname()}: {exc}; if rank 0 "
            "found it, the run directory is not shared (a node-local directory): put it on "
            "a filesystem every node mounts at the same path and give that path on every "
            "node") from None


def train_or_continue(cfg: RunConfig, out_dir: Path, *, progress: bool = True
                      ) -> dict[str, Any]:
    """``exactstep train --resume auto`` (S10): the same command run again on the same
    ``out_dir`` (an elastic restart, a scheduler requeue) continues the run there.

    No ``manifest.json`` in ``out_dir``: an ordinary new run (``train``). A manifest:
    ``resume``'s own continuation (``continue_run``: the newest verifying checkpoint,
    recovery and quarantine, journal checks, the recorded numerics environment), with
    ``cfg`` rebuilt and required to give the run's manifest (S4), else refused naming
    the differing fields before anything changes; no checkpoint published yet: window
    0 under that manifest, the first attempt's journals and leftovers dropped.
    A warm-started run (``resume --warm-start``) continues too: the command line
    cannot name its parent, so ``cfg`` must give the manifest but for its ``parent``
    section, which the continuation takes from the saved manifest (provenance), and
    window 0 starts again from that parent's weights (``parent_checkpoint``).
    Each rank decides before it joins the process group, and no rank writes the
    manifest before every rank has joined, so the ranks of one job agree.
    """
    if not (Path(out_dir) / MANIFEST_FILE).is_file():
        return train(cfg, out_dir, progress=progress)
    started = time.perf_counter()
    old = read_manifest(out_dir)

    def same_run(saved: Manifest, current: Manifest) -> None:
        if saved.digest != current.digest:
            differing = diff_manifests(saved, current)
            migrate = (f", or move it to this world size with 'exactstep resume {out_dir} "
                       "--reshard'" if "parallel.world_size" in differing else "")
            raise ResumeError(
                f"--resume auto: {out_dir} holds another run; its manifest differs from "
                f"this command's configuration in: {', '.join(differing) or '(digest only)'}"
                f"; nothing was changed; run the original command again{migrate}, or "
                "choose a new --out")

    with hold_run_dir(out_dir, "--out"):
        return continue_run(out_dir, old, cfg, (), None, False, progress, started,
                            same_run=same_run)


def continue_run(run_dir: Path, old: Manifest, cfg: RunConfig, overrides: Sequence[str],
                 from_checkpoint: Path | None, reshard: bool, progress: bool,
                 started: float, *,
                 same_run: Callable[[Manifest, Manifest], None] = require_same_manifest
                 ) -> dict[str, Any]:
    """``resume``'s exact continuation, with the run directory held; ``same_run``
    refuses a rebuilt manifest that is not the run's (S4; ``train --resume auto``
    words its refusal its own way, S10). The rebuilt manifest carries the run's own
    recorded ``parent``; a warm start with no checkpoint yet starts window 0 from
    the parent checkpoint, verified first (``parent_checkpoint``)."""
    point = choose_resume_point(Path(run_dir) / "checkpoints", from_checkpoint)
    parent = recorded_parent(old)
    origin = None  # the parent checkpoint a warm start's window 0 starts from (S4)
    if point.path is None:
        refuse_lost_checkpoints(Path(run_dir), cfg)
        if parent is not None:
            origin = parent_checkpoint(Path(run_dir), parent)
    recorded = recorded_environment(point.path, old, DcpFormat)
    if recorded is not None and not overridden(overrides, "train.threads"):
        cfg = replace(cfg, train=replace(cfg.train, threads=int(recorded["threads"])))
    if recorded is not None and not overridden(overrides, "train.compile"):
        cfg = replace(cfg, train=replace(cfg.train, compile=bool(recorded.get("compile"))))
    if recorded is not None and not overridden(overrides, "numerics.flush_denormal"):
        flush = bool(environment.recorded_value(recorded, "flush_denormal"))
        cfg = replace(cfg, numerics=replace(cfg.numerics, flush_denormal=flush))
    with environment.numerics_restored():
        run = build_run(cfg, run_dir, parent=parent)  # the run's own parent (S4)
        try:
            check_shared_run_dir(run.ctx, run_dir)  # every node sees it (D1)
            keep_run_manifest(run, old, reshard)
            same_run(old, run.manifest)
            next_window, events, marks = 0, [], {}
            if origin is not None:  # window 0 of a warm start: the parent's weights
                load_parent_weights(origin, run)
            if point.path is not None:
                restored = run.checkpointer.restore(point.path, reshard=reshard)
                check_progress_digest(restored.progress, run.manifest, point.path)
                check_journals(run_dir, restored.journals, point.path,
                               marks_of=run.checkpointer.journal_marks)
                next_window, events, marks = (restored.next_window, restored.events,
                                              restored.journals)
            notes = [point.note, f"resuming {run_dir} at window {next_window}"
                     + (f" from {point.path.name}" if point.path else "")
                     + (f" from the parent's weights ({origin})" if origin else ""),
                     model_note(run.model)]
            changed = environment.differences(recorded, run.environment)
            if changed:
                notes.append(f"declared non-bitwise continuation at window {next_window}: "
                             f"the numerics environment differs ({'; '.join(changed)})")
                events.append(continuation_record(next_window, recorded, run.environment,
                                                  changed))
            run_windows(run, next_window, progress,
                        lambda: reopen_journals(run, marks, events, notes))
            return finish(run, started)
        finally:
            shutdown(run.ctx)


def recorded_parent(manifest: Manifest) -> dict[str, Any] | None:
    """A warm-started run's ``parent`` section as its manifest recorded it (S4), else
    ``None``: what every continuation of the run carries into its rebuilt manifest
    (the command line cannot name it; it is the run's provenance)."""
    parent = manifest.to_dict().get("parent")
    return dict(parent) if parent is not None else None


def parent_checkpoint(run_dir: Path, parent: dict[str, Any]) -> Path:
    """The checkpoint a warm-started run killed before its first checkpoint starts
    window 0 from again (S4): the one its manifest's ``parent`` names, refused unless
    it still verifies (S6) and both the parent's manifest and the checkpoint's
    progress still carry the recorded manifest digest. A relative ``run_dir`` (a
    warm start recorded before parents were absolute) is read from the current
    directory. Never a silent
    start from a fresh initialisation: ``CheckpointError`` / ``ResumeError`` naming
    what to restore or run instead, before anything is built or written."""
    parent_dir = Path(str(parent.get("run_dir")))
    path = parent_dir / "checkpoints" / str(parent.get("checkpoint"))
    digest = str(parent.get("manifest_digest"))
    fix = (f"nothing was changed; restore {path} as the warm start read it, or start "
           f"a new warm start with 'exactstep resume PARENT --warm-start NEW_DIR'")
    start = (f"{run_dir} is a warm start killed before its first checkpoint; its window "
             f"0 starts from its parent's weights, but")
    if not path.is_dir():
        raise CheckpointError(f"{start} the parent checkpoint {path} recorded in "
                              f"{run_dir / MANIFEST_FILE} is gone; {fix}")
    report = verify_checkpoint(path)
    if not report.ok:
        raise CheckpointError(f"{start} the parent checkpoint {path} failed verification: "
                              f"{report.summary()}; {fix}")
    try:
        parent_digest = read_manifest(parent_dir).digest
    except (ResumeError, CheckpointError) as exc:
        raise ResumeError(f"{start} the parent's manifest cannot be read ({exc}); "
                          f"{fix}") from None
    written = str(checkpoint_progress(path, DcpFormat).get("manifest_digest"))
    changed = [f"{where} {now[:12]}" for where, now in (
        (f"{parent_dir / MANIFEST_FILE} is now manifest", parent_digest),
        (f"{path.name} was written under manifest", written)) if now != digest]
    if changed:
        raise ResumeError(f"{start} the parent has changed: {' and '.join(changed)}, not "
                          f"the recorded {digest[:12]}; {fix}")
    return path


def load_parent_weights(path: Path, run: Run) -> None:
    """``path``'s weights into a warm start's model (S4); weights that do not fit the
    model the run's settings build (another width, another family's model) are a
    ``ResumeError`` naming the first differences, not PyTorch's traceback."""
    try:
        load_weights(path, run.model, DcpFormat(run.ctx))
    except RuntimeError as exc:
        if "state_dict" not in str(exc):
            raise
        detail = " ".join(str(exc).split()[1:])
        detail = detail if len(detail) <= 240 else detail[:240] + " ..."
        raise ResumeError(
            f"the weights of {path} do not fit the model this warm start's settings build "
            f"({detail}); keep the parent's model.* settings and a family over the same "
            "model, or start a new run with 'exactstep train'") from None


def overridden(overrides: Sequence[str], key: str) -> bool:
    """Whether ``--set key=...`` is among ``overrides``."""
    return any(item.partition("=")[0].strip() == key for item in overrides)


#: the manifest fields a declared migration (``--reshard``) may change (S7): the world
#: size and the axes a replica is split along, as the config and the layout record them
RESHARD_FIELDS = frozenset({"parallel.world_size", "parallel.layout",
                            *(f"{where}parallel.{axis}" for where in ("", "config.")
                              for axis in (*MODEL_AXIS_KEYS, "schedule"))})


def keep_run_manifest(run: Run, old: Manifest, reshard: bool) -> None:
    """Keep the run's own manifest when the rebuilt one differs only where a resume
    may differ: the numerics environment (a declared continuation, S9) and, with
    ``reshard``, the world size and the layout's axes (``parallel.tp``: a checkpoint
    loaded by its logical names, a declared migration, S7)."""
    def migrated(field: str) -> bool:
        return field in RESHARD_FIELDS or field.startswith("parallel.layout.")

    def allowed(field: str) -> bool:
        return (reshard and migrated(field)) or field.split(".")[0] == "environment"

    fields = diff_manifests(old, run.manifest)
    layout = [f for f in fields if migrated(f)]
    if not reshard and layout and all(migrated(f) or allowed(f) for f in fields):
        raise ResumeError(
            f"the run was written by another layout ({', '.join(layout)} differ); pass "
            "--reshard to continue it under this one (the checkpoint loaded by its logical "
            "names, the data re-partitioned: a declared migration), or resume with the "
            "original parallel settings and process count")
    if fields and all(allowed(f) for f in fields):
        run.manifest = old
        run.checkpointer.manifest_digest = old.digest


def continuation_record(window: int, recorded: dict[str, Any] | None, now: dict[str, Any],
                        changed: list[str]) -> dict[str, Any]:
    """The ledger's account of a declared, non-bitwise continuation (S9)."""
    return {"event": "CONTINUATION", "bitwise": False, "next_window": window,
            "differs": changed, "recorded": recorded, "environment": now}


def refuse_lost_checkpoints(run_dir: Path, cfg: RunConfig) -> None:
    """A run whose history proves a checkpoint was published, but none is left, is not
    started again from window 0 (S8): that would rewrite the history.

    Evidence: ``summary.json`` (a run finishes only after its final checkpoint), or
    a ledger with more windows than the checkpoint cadence (the checkpoint after
    window ``checkpoint.every`` is published before the next window is logged).
    """
    windows = ledger_windows(run_dir / LEDGER_FILE)
    every = cfg.checkpoint.every
    if (run_dir / "summary.json").exists():
        evidence = "summary.json shows the run finished, which publishes a final checkpoint"
    elif every and windows > every:
        evidence = (f"ledger.jsonl holds {windows} windows, and a checkpoint is published "
                    f"every {every}")
    else:
        return
    raise CheckpointError(
        f"no checkpoint in {run_dir / 'checkpoints'} verifies, but {evidence}: the "
        "checkpoints were lost; nothing was changed; restore the checkpoints directory "
        "from a copy, or start a new run with a new --out"
    )


def ledger_windows(path: Path) -> int:
    """How many window lines a ledger holds (event lines, such as RESHARD, excluded)."""
    if not path.is_file():
        return 0
    count = 0
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            count += isinstance(record, dict) and "window" in record
    return count


def reopen_journals(run: Run, marks: dict[str, dict], events: list[dict],
                    notes: Sequence[str | None]) -> tuple[Ledger | None, Journal | None]:
    """Rank 0, once every check passed: drop unpublished leftovers and the journal
    tails written after the checkpoint, record migration and continuation events,
    print ``notes``."""
    if not run.ctx.is_main:
        return None, None
    clean_uncommitted(run.out_dir / "checkpoints")
    if not marks:
        ledger, metrics = start_journals(run, notes, fresh_manifest=False)
    else:
        ledger = Ledger.open_at(run.out_dir / LEDGER_FILE, marks[LEDGER_FILE])
        metrics = Journal.open_at(run.out_dir / METRICS_FILE, marks[METRICS_FILE])
        rollouts = (Journal.open_at(run.out_dir / ROLLOUTS_FILE, marks[ROLLOUTS_FILE])
                    if ROLLOUTS_FILE in marks else None)
        announce(notes)
        attach(run, ledger, metrics, rollouts)
    assert ledger is not None
    for event in events:
        ledger.append(event)
    return ledger, metrics


def warm_start(run_dir: Path, old: Manifest, cfg: RunConfig, new_dir: Path,
               from_checkpoint: Path | None, progress: bool) -> dict[str, Any]:
    """A new run in ``new_dir`` from ``run_dir``'s weights only (S4): fresh optimizer,
    schedule and counters; the parent (its absolute path, checkpoint and manifest
    digest) is recorded in the new manifest, which every continuation keeps."""
    if "WORLD_SIZE" in os.environ:
        raise DistributedError("--warm-start runs in one process; launch it without torchrun")
    point = choose_resume_point(Path(run_dir) / "checkpoints", from_checkpoint)
    if point.path is None:
        raise ResumeError(f"{run_dir} has no checkpoint to warm-start from yet")
    # absolute: a restart of window 0 finds the parent from any directory (S4)
    parent = {"run_dir": str(Path(run_dir).absolute()), "checkpoint": point.path.name,
              "manifest_digest": old.digest}
    started = time.perf_counter()
    with hold_run_dir(new_dir, "--warm-start", new=True), environment.numerics_restored():
        run = build_run(cfg, new_dir, parent=parent)
        try:
            load_parent_weights(point.path, run)
            return train_new(run, started, progress)
        finally:
            shutdown(run.ctx)


__all__ = ["resume", "train_or_continue"]
