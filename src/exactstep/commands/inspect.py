"""``exactstep inspect``: the parallel layout a run would have (D1, D3), then rows of
the first microbatch as the model sees them: input -> target, segment, position,
masks (R7).

The layout is what the run's manifest records (``Layout.section()``: every axis, the
world size, the mesh order) and which axis coordinates and loss ownership each rank
gets; ``--world`` gives the run's number of processes (nothing is launched), and a
layout ``train`` refuses is refused here with the same line.
"""

from __future__ import annotations

import argparse

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.families.inspect import inspect_rows
from exactstep.parallel.layout import DIMS, Layout, check_built, layout_sizes

MAX_RANK_LINES = 32  # a larger job lists its first ranks only


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    world = args.world
    if world < 1:
        raise ConfigError(f"--world expects a positive number of processes; got {world}")
    p = cfg.parallel
    sizes = layout_sizes(world, tp=p.tp, pp=p.pp, cp=p.cp)
    check_built(sizes)
    print("\n".join(layout_lines(Layout(**sizes), p.strategy)))
    print(inspect_rows(cfg, parse_range(args.rows), split=args.split))
    return 0


def layout_lines(layout: Layout, strategy: str) -> list[str]:
    """The layout as ``inspect`` prints it: ``layout.section()`` on one line, then one
    line per rank (its coordinate on every axis, and whether its numerator and NLL
    count in the reported sums), the first ``MAX_RANK_LINES`` ranks of a larger job."""
    section = layout.section()
    world = section["world_size"]
    axes = " x ".join(f"{dim} {section[dim]}" for dim in section["mesh_order"])
    lines = [f"layout: {world} process{'es' if world != 1 else ''} = {axes} (mesh order "
             f"{', '.join(section['mesh_order'])}, the last innermost); parallel.strategy = "
             f"{strategy}",
             "  rank " + " ".join(f"{dim:>3}" for dim in DIMS) + "  loss owner"]
    for rank in range(min(world, MAX_RANK_LINES)):
        place = Layout(**layout.sizes(), rank=rank)
        coords = place.coords()
        lines.append(f"  {rank:>4} " + " ".join(f"{coords[dim]:>3}" for dim in DIMS)
                     + f"  {'yes' if place.loss_owner else 'no'}")
    if world > MAX_RANK_LINES:
        lines.append(f"  ... ranks {MAX_RANK_LINES}..{world - 1} not shown")
    return lines


def parse_range(text: str) -> range:
    start, sep, stop = text.partition(":")
    try:
        a = int(start) if start else 0
        b = int(stop) if sep and stop else a + 1
    except ValueError:
        raise ConfigError(f"--rows expects A:B (e.g. 0:2), got {text!r}") from None
    if a < 0 or b <= a:
        raise ConfigError(f"--rows expects 0 <= A < B, got {text!r}")
    return range(a, b)
