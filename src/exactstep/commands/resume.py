"""``exactstep resume``: continue a run exactly, reshard it, or warm-start a new run
from its weights (S4, S7)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.run.continuation import resume


def run(args: argparse.Namespace) -> int:
    resume(
        Path(args.run_dir),
        from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
        overrides=args.overrides,
        warm_start_dir=Path(args.warm_start) if args.warm_start else None,
        reshard=args.reshard,
        progress=not args.no_progress,
    )
    return 0
