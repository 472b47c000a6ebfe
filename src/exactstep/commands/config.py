"""``exactstep config``: every configuration key with its default and kind (X2)."""

from __future__ import annotations

import argparse

from exactstep.config import config_keys


def run(args: argparse.Namespace) -> int:
    for key, default, kind in config_keys():
        print(f"{key} = {default!r}  # {kind}")
    return 0
