"""Host-to-device copies without a hidden host sync (U7).

A copy from pageable host memory to a CUDA device is synchronous for the host (the
driver stages it), and a copy without ``non_blocking`` waits for the device: either
is a sync on the hot path. Host-built tensors (batches, coefficients, index tensors)
are therefore pinned first and copied with ``non_blocking=True``. PyTorch's caching
host allocator keeps each pinned block alive until the copy that reads it has run,
so the host tensor may be dropped right after the call. Off CUDA these are plain
``.to(device)`` calls (no pinning without CUDA).
"""

from __future__ import annotations

import torch

from exactstep.rows.batch import Batch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA is pinned and copied async."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def batch_to_device(batch: Batch, device: torch.device | str) -> Batch:
    """Every tensor of ``batch`` on ``device``, as ``host_to_device`` moves one."""
    device = torch.device(device)
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)
