"""Lazy public surfaces for exactstep's packages.

A package lists its public names and the module that defines each; a name is
imported on first use. So ``import exactstep`` or ``import exactstep.model.config``
(which the CLI does to print a usage error) never pays for torch, while
``from exactstep.model import build_model`` works as written.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` from ``name -> module``."""
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
