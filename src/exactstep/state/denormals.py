"""Denormal floats flushed on every thread that computes (S9).

x86's flush-to-zero and denormals-are-zero bits live in each thread's MXCSR register,
and ``torch.set_flush_denormal`` sets the calling thread's only: an intra-op worker
that already exists keeps computing on denormals (slowly, and to other values).
``set_flush_denormal`` sets the bits on the calling thread and then, inside one
parallel region of PyTorch's own OpenMP runtime, on every thread of its pool; threads
started later inherit them from the thread that starts them. ``flushed`` observes the
result through a parallel PyTorch op, which is what the environment records.
Design and measurements: docs/design/state.md#statedenormalspy (S9).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator

import torch

#: The bits of a float32 denormal (2**-127, half the smallest normal): a probe's input is
#: made from them by a view, since converting a Python float would itself be flushed.
DENORMAL_BITS = 0x00400000
#: Elements per thread of the probe: twice ATen's grain size (32768), so every thread
#: of the pool gets a chunk of the element-wise op.
PROBE_PER_THREAD = 1 << 16

_REGION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_lock = threading.Lock()


def supported() -> bool:
    """Whether this CPU can flush denormals (x86 with SSE's DAZ bit): PyTorch's answer,
    asked without changing the calling thread's setting."""
    before = flushed_here()
    ok = torch.set_flush_denormal(True)
    torch.set_flush_denormal(before)
    return bool(ok)


def flushed_here() -> bool:
    """Whether the calling thread treats a denormal input as zero (one element: the op
    runs on this thread)."""
    return not bool(denormals(1).mul(1.0).view(torch.int32).any())


def flushed() -> bool:
    """Whether every thread an intra-op parallel op uses flushes denormals: an
    element-wise op over ``PROBE_PER_THREAD`` elements per thread, whose every chunk
    must come back zero (a thread left unset returns its chunk unchanged). Results are
    read as bits: a comparison of floats would itself treat denormals as zero where the
    comparing thread flushes them."""
    probe = denormals(PROBE_PER_THREAD * torch.get_num_threads())
    return flushed_here() and not bool(probe.mul(1.0).view(torch.int32).any())


def denormals(n: int) -> torch.Tensor:
    """``n`` float32 denormals, written as bits (no floating-point operation)."""
    return torch.full((n,), DENORMAL_BITS, dtype=torch.int32).view(torch.float32)


def set_flush_denormal(on: bool) -> bool:
    """Flush denormals to zero (``on``) or compute on them, on the calling thread and on
    every thread of PyTorch's intra-op pool; returns ``flushed()`` afterwards.

    The pool's threads are reached through one parallel region of the OpenMP runtime
    PyTorch itself calls (``GOMP_parallel``, which libgomp, LLVM's libomp and Intel's
    runtime all export): each thread sets its own register. The region is as wide as
    the larger of the thread count and the CPU count (``pool_size``): an idle thread
    that a later ``torch.set_num_threads`` wakes again keeps the register it had, so
    it is set now too. Where no such runtime is
    loaded (a build with another thread pool), only the calling thread is set, and
    ``flushed()`` says whether that was enough. A CPU without the bits
    (``supported()`` false) computes on denormals whatever is asked.
    """
    torch.set_flush_denormal(on)
    region = _parallel_region()
    if region is not None:
        def each_thread(_: int | None) -> None:
            torch.set_flush_denormal(on)

        callback = _REGION(each_thread)  # kept alive for the call
        with _lock:  # one region at a time: the pool is the process's
            region(callback, None, ctypes.c_uint(pool_size()), ctypes.c_uint(0))
    return flushed()


def pool_size() -> int:
    """The threads a parallel region may use in this process, now or after a
    ``torch.set_num_threads`` up to the CPU count."""
    return max(torch.get_num_threads(), os.cpu_count() or 1)


@contextlib.contextmanager
def denormals_restored() -> Iterator[None]:
    """Give the process its denormal setting back on exit (the calling thread's, then
    set on every thread): a run sets its own, a library caller keeps the one it had."""
    previous = flushed_here()
    try:
        yield
    finally:
        set_flush_denormal(previous)


@functools.cache
def _parallel_region():
    """``GOMP_parallel(fn, data, num_threads, flags)`` of the OpenMP runtime loaded with
    PyTorch, or None where PyTorch runs no OpenMP runtime."""
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return None
    with contextlib.suppress(OSError, AttributeError):
        function = ctypes.CDLL(None).GOMP_parallel  # resolved in the process's own scope
        function.restype = None
        function.argtypes = [_REGION, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        return function
    return None
