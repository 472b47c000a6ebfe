"""``exactstep eval``: a finished run's held-out loss, perplexity and bits per byte
(E1)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.run.finished_run import evaluate_run


def run(args: argparse.Namespace) -> int:
    report = evaluate_run(
        Path(args.run_dir),
        from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
    )
    print(report.format())
    return 0
