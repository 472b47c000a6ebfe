"""Opening a finished run: the one way ``eval``, ``export`` and anything else that reads
a run get from a run directory to a model. Manifest -> configuration -> the checkpoint a
resume would choose (or ``--from``) -> the family's tokenizer, data and compiler -> the
model with those weights, in the thread count the checkpoint recorded (S9).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from exactstep.config import RunConfig, config_from_manifest
from exactstep.errors import ResumeError
from exactstep.eval import EvalReport, Validator
from exactstep.families import FamilyParts, open_family
from exactstep.parallel.dcp_format import DcpFormat
from exactstep.parallel.process_group import resolve_rank_device, single_process
from exactstep.run.host_memory import pin_mmap_threshold
from exactstep.state import denormals, environment
from exactstep.state.checkpointer import load_weights, recorded_environment
from exactstep.state.manifest import Manifest, read_manifest
from exactstep.state.resume import choose_resume_point


@dataclass(frozen=True)
class FinishedRun:
    """A run opened for reading: its manifest and configuration, the checkpoint chosen,
    the family's parts, the model holding that checkpoint's weights, the device, and
    one line on the numerics environment against the checkpoint's record (S9)."""

    run_dir: Path
    manifest: Manifest
    cfg: RunConfig
    checkpoint: Path
    parts: FamilyParts
    model: torch.nn.Module
    device: torch.device
    environment: str


def run_config(run_dir: Path) -> tuple[Manifest, RunConfig]:
    """The run's verified manifest and the configuration it recorded (X2)."""
    manifest = read_manifest(Path(run_dir))
    return manifest, config_from_manifest(manifest)


@contextlib.contextmanager
def open_finished_run(run_dir: Path, *, from_checkpoint: Path | None = None,
                      device: torch.device | str | None = None,
                      purpose: str = "evaluate") -> Iterator[FinishedRun]:
    """Open ``run_dir`` at ``from_checkpoint`` or the checkpoint a resume would choose.

    Inside, the process runs with the checkpoint's recorded thread count; its own is
    given back on exit. Raises ``ResumeError`` when no checkpoint was published yet
    (``purpose`` names what the caller wanted to do) and what each stage refuses.
    """
    run_dir = Path(run_dir)
    manifest, cfg = run_config(run_dir)
    point = choose_resume_point(run_dir / "checkpoints", from_checkpoint)
    if point.path is None:
        raise ResumeError(f"{run_dir} has no checkpoint to {purpose} yet; train or resume it "
                          "first")
    device = torch.device(device) if device is not None else resolve_rank_device(
        cfg.train.device, 0)
    recorded = recorded_environment(point.path, manifest, DcpFormat)
    pin_mmap_threshold()  # as the run did (L1)
    with environment.numerics_restored():
        if recorded is not None:
            torch.set_num_threads(int(recorded["threads"]))
            denormals.set_flush_denormal(environment.recorded_value(recorded, "flush_denormal"))
        now = environment.capture(device)
        changed = environment.differences(recorded, now)
        said = environment.describe(now) + (
            f" (differs from the checkpoint's record: {'; '.join(changed)})" if changed
            else " (as the checkpoint recorded)")
        parts = open_family(cfg)
        model = parts.family.build_model(cfg, parts.tokenizer.vocab_size).to(device)
        load_weights(point.path, model, DcpFormat(single_process(device)))
        yield FinishedRun(run_dir, manifest, cfg, point.path, parts, model, device, said)


def evaluate_run(run_dir: Path, *, from_checkpoint: Path | None = None) -> EvalReport:
    """``exactstep eval``: a run's checkpoint on its validation split (E1, L5), with
    the unigram baseline and the numerics environment it was evaluated in."""
    with open_finished_run(run_dir, from_checkpoint=from_checkpoint) as run:
        cfg, parts = run.cfg, run.parts
        tokenizer = parts.tokenizer
        validator = Validator(run.model, parts.data.train, parts.data.val, cfg.batch,
                              tokenizer.pad_id, tokenizer.vocab_size, run.device,
                              cfg.train.eval_tokens, byte_lengths=tokenizer.byte_lengths(),
                              compiler=parts.compiler)
        return EvalReport(run.checkpoint.name, validator.evaluate(),
                          validator.baseline_bits(), run.environment,
                          parts.data.section.get("teacher"))
