"""``exactstep train``: a new run in ``--out``; with ``--resume auto`` the same command
run again continues the run there (S10)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.config import load_config
from exactstep.run.continuation import train_or_continue
from exactstep.run.runner import train


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.resume == "auto":
        train_or_continue(cfg, Path(args.out), progress=not args.no_progress)
        return 0
    train(cfg, Path(args.out), progress=not args.no_progress)
    return 0
