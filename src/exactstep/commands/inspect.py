"""``exactstep inspect``: print rows of the first microbatch as the model sees them:
input -> target, segment, position, masks (R7)."""

from __future__ import annotations

import argparse

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.families.inspect import inspect_rows


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    print(inspect_rows(cfg, parse_range(args.rows), split=args.split))
    return 0


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
