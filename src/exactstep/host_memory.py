"""Host memory: big freed tensors go back to the system, small ones are reused (L1).

glibc raises its mmap threshold up to 32 MiB as mapped blocks are freed, and the heap
then fragments (Qwen2.5-0.5B's shape: 4.9 GB instead of 3.0); a 128 KiB pin page-
faulted every tensor anew (the default run twice as slow). ``pin_mmap_threshold``
pins it at 6 MiB: smaller tensors are reused from the heap, bigger ones return on
free. Measurements and the choice: docs/design/performance.md#host-memory.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (<malloc.h>)
MMAP_THRESHOLD = 6 << 20  # bytes; chosen by the figures in docs/design/performance.md
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # free bytes kept at the heap's top (glibc's rule)
#: the environment variables through which a user tunes glibc's malloc themselves
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_MAX_")


def users_own_setting() -> bool:
    """Whether the user tuned glibc's malloc in the environment (their choice stands)."""
    return (any(name in os.environ for name in USER_SETTINGS)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at ``MMAP_THRESHOLD`` and its trim threshold at
    ``TRIM_THRESHOLD`` (a pinned threshold stops glibc adjusting either); True when both
    were set. Nothing
    is done where the user tuned malloc (``users_own_setting``) or the C library is not
    glibc (no ``mallopt``). Where tensors live changes no value, so resume stays
    bitwise whatever this does (S5)."""
    if sys.platform != "linux" or users_own_setting():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
