"""``exactstep checkpoint verify``: recompute a checkpoint's digests (S6); an export
directory is verified as one, against its passport (H3)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.artifacts.export import PASSPORT, is_export, verify_export
from exactstep.state.store import latest_checkpoint, verify_checkpoint


def run(args: argparse.Namespace) -> int:
    return verify_command(Path(args.path))


def verify_command(path: Path) -> int:
    """Verify one checkpoint, or a run directory's ``LATEST`` checkpoint (S6); an export
    directory is verified as one, against its passport (H3)."""
    if is_export(path):
        report = verify_export(path)
        print(report.format(f"export {path}: a Hugging Face export, not a checkpoint; its "
                            f"{PASSPORT} digests (as exactstep export verify checks them)"))
        return 0 if report.ok else 1
    target = path
    if (path / "checkpoints").is_dir():
        target = latest_checkpoint(path / "checkpoints") or path / "checkpoints"
    report = verify_checkpoint(target)
    print(report.format())
    if report.ok:  # what a bitwise continuation from it depends on (S9)
        from exactstep.parallel.dcp_format import DcpFormat  # lazy: a verified one only
        from exactstep.state.checkpointer import checkpoint_progress  # lazy: the same
        from exactstep.state.environment import describe  # lazy: the same

        recorded = checkpoint_progress(target, DcpFormat).get("environment")
        print(f"  numerics  {describe(recorded)}")
    return 0 if report.ok else 1
