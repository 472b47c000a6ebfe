"""``exactstep export``: a run as a Hugging Face directory, checked; ``export verify
DIR`` recomputes an export's passport digests (H3)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.artifacts.export import export_run, verify_export
from exactstep.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    if export_verify_requested(args):
        return export_verify_command(Path(args.export_dir))
    report = export_run(
        Path(args.run_dir), Path(args.out),
        from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
        adapter=args.adapter,
    )
    print(report.format())
    return 0


def export_verify_requested(args: argparse.Namespace) -> bool:
    """``export verify DIR`` (True) or ``export RUN_DIR --out DIR`` (False); any other
    combination is a ``ConfigError`` naming both forms."""
    forms = "export with 'exactstep export RUN_DIR --out DIR', check one with " \
            "'exactstep export verify DIR'"
    if args.run_dir == "verify" and (args.export_dir is not None or args.out is None):
        if args.export_dir is None:
            raise ConfigError(f"exactstep export verify needs the export directory: {forms}")
        if args.out is not None or args.from_checkpoint is not None:
            raise ConfigError(f"exactstep export verify DIR takes no --out or --from; {forms}")
        return True
    if args.export_dir is not None:
        raise ConfigError(f"exactstep export: unexpected argument {args.export_dir!r}; {forms}")
    if args.out is None:
        raise ConfigError("exactstep export: the following arguments are required: --out; "
                          "see 'exactstep export --help'")
    return False


def export_verify_command(path: Path) -> int:
    """``exactstep export verify DIR``: the passport's digests, OK (0) or FAILED (1)."""
    report = verify_export(path)
    print(report.format())
    return 0 if report.ok else 1
