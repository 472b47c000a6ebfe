"""Freed host memory goes back to the system (L1).

glibc's malloc takes a block above its mmap threshold (128 KiB) from ``mmap`` and
returns it on free, but each such free raises the threshold (up to 32 MiB), so later
activation-sized tensors come from the heap and stay resident after they are freed.
``keep_mmap_threshold`` pins the threshold at glibc's default, which turns the raising
off; every run calls it before building its model.
Design and derivations: docs/design/objective.md#host-memory-l1
"""

from __future__ import annotations

import ctypes
import os
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's <malloc.h>
DEFAULT_THRESHOLD = 128 * 1024  # glibc's own initial value


def keep_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at its default; True when it was set. Nothing is done
    where the user set ``MALLOC_MMAP_THRESHOLD_`` (their choice stands) or the C library
    is not glibc (no ``mallopt``)."""
    if sys.platform != "linux" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, DEFAULT_THRESHOLD))
