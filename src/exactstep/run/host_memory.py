"""Host memory: big freed tensors go back to the system, small ones are reused (L1).

glibc raises its mmap threshold up to 32 MiB as mapped blocks are freed, and the heap
then fragments (Qwen2.5-0.5B's shape: 4.9 GB instead of 3.0); a 128 KiB pin page-
faulted every tensor anew (the default run twice as slow). ``pin_mmap_threshold``
pins it: a run first at 6 MiB, then at ``threshold_for`` its own shapes once its model
is built: above its largest per-layer activation (reused from the heap), but at the
size of the layer inputs that activation checkpointing keeps across a window (mapped,
so they pin no heap). Measurements and the choice: docs/design/performance.md#host-memory.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (<malloc.h>)
MMAP_THRESHOLD = 6 << 20  # bytes: before a run knows its shapes, and the least it pins
MAX_THRESHOLD = 32 << 20  # glibc's largest on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
KEPT_FLOOR = 1 << 20  # kept tensors smaller than this fragment nothing worth a fault
MIB = 1 << 20
#: the environment variables through which a user tunes glibc's malloc themselves
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                 "MALLOC_MMAP_MAX_")


def users_own_setting() -> bool:
    """Whether the user tuned glibc's malloc in the environment (their choice stands)."""
    return (any(name in os.environ for name in USER_SETTINGS)
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""))


def threshold_for(widest_bytes: int, kept_bytes: int | None = None) -> int:
    """The mmap threshold for a run whose largest per-layer activation (one micro-batch,
    the vocabulary-wide logits aside: they are chunked) is ``widest_bytes``, and whose
    activation checkpointing keeps a tensor of ``kept_bytes`` per layer across the
    window (``None``: no checkpointing).

    Above the widest activation, rounded up to the next MiB (at least
    ``MMAP_THRESHOLD``, at most ``MAX_THRESHOLD``): every per-layer tensor is reused
    from the heap. With checkpointing, no more than ``kept_bytes`` (at least
    ``KEPT_FLOOR``): a kept input is mapped, since a heap block alive across the
    window, under the transients made and freed around it, holds the heap's freed
    memory resident (the fragmentation measured at Qwen2.5-0.5B's shape)."""
    above = (widest_bytes // MIB + 1) * MIB
    threshold = min(MAX_THRESHOLD, max(MMAP_THRESHOLD, above))
    if kept_bytes is not None:
        threshold = min(threshold, max(KEPT_FLOOR, kept_bytes))
    return threshold


def pin_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes and its trim threshold at twice
    it (glibc's own rule for a raised threshold; a pinned threshold stops glibc
    adjusting either); True when both were set. Nothing
    is done where the user tuned malloc (``users_own_setting``) or the C library is not
    glibc (no ``mallopt``). Where tensors live changes no value, so resume stays
    bitwise whatever this does (S5)."""
    if sys.platform != "linux" or users_own_setting():
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, 2 * threshold))
