"""``exactstep smoke``: one smoke test of ``exactstep.smoke``, every path of a device
run once; exit 1 when a check failed."""

from __future__ import annotations

import argparse
import importlib
import json


def run(args: argparse.Namespace) -> int:
    return smoke_command(args.name, as_json=args.json, dry_run=args.dry_run)


def smoke_command(name: str, *, as_json: bool, dry_run: bool) -> int:
    """Run one smoke test (``exactstep.smoke``); exit 1 when a check failed."""
    module = importlib.import_module(f"exactstep.smoke.{name}")
    figures = module.run(quick=False, dry_run=dry_run)
    if as_json:
        print(json.dumps({"smoke": name, "dry_run": dry_run, **figures}, sort_keys=True,
                         default=str))
    else:
        from exactstep.bench.common import format_figures  # lazy: the table only

        print(format_figures(name, figures))
    return 0 if figures.get("ok", True) else 1
