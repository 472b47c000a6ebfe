"""Host-to-device copies without a hidden host sync (U7).

Every host-built tensor bound for CUDA (batches, coefficients, index tensors) goes
through ``host_to_device`` / ``batch_to_device``: pinned, then copied with
``non_blocking=True``; off CUDA these are plain ``.to(device)`` calls.
Design and derivations: docs/design/rows.md#rowstransferpy (U7).
"""

from __future__ import annotations

import torch

from exactstep.rows.batch import Batch


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; a host tensor bound for CUDA is pinned and copied async.

    The host tensor may be dropped right after the call: PyTorch's caching host
    allocator keeps the pinned block alive until the copy that reads it has run.
    """
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
