"""``exactstep bench``: one benchmark measured side by side against a baseline, or
``bench list``; importing this module loads no benchmark and no torch."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil

from exactstep.errors import ConfigError

BENCH_PACKAGE = "exactstep.bench"  # each module in it but the helpers is one benchmark
BENCH_HELPERS = frozenset({"common"})


def run(args: argparse.Namespace) -> int:
    return bench_command(args.name, quick=args.quick, as_json=args.json,
                         dry_run=args.dry_run)


def bench_names() -> list[str]:
    """The benchmarks shipped in ``exactstep.bench``, sorted: its modules minus helpers.

    Found with ``pkgutil`` in the installed package (not a source-checkout path), so
    ``exactstep bench`` works the same from a wheel; no benchmark is imported to list them.
    """
    package = importlib.import_module(BENCH_PACKAGE)
    return sorted(
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if not info.ispkg and info.name not in BENCH_HELPERS and not info.name.startswith("_")
    )


def bench_command(name: str, *, quick: bool, as_json: bool, dry_run: bool = False) -> int:
    """Run one benchmark and print its figures; exit 1 when it reports ``ok: false``
    (a smoke test whose check failed). ``--dry-run`` goes only to a benchmark whose
    ``run`` accepts it."""
    names = bench_names()
    if name == "list":
        for n in names:
            print(n)
        return 0
    if name not in names:
        raise ConfigError(f"unknown benchmark {name!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"{BENCH_PACKAGE}.{name}")
    options = {"quick": quick}
    if dry_run:
        if "dry_run" not in inspect.signature(module.run).parameters:
            raise ConfigError(f"benchmark {name!r} has no --dry-run; run it without")
        options["dry_run"] = True
    figures = module.run(**options)
    if as_json:
        print(json.dumps({"bench": name, **options, **figures}, sort_keys=True, default=str))
    else:
        from exactstep.bench.common import format_figures  # lazy: the table only

        print(format_figures(name, figures))
    return 0 if figures.get("ok", True) else 1
