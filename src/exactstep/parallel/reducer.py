"""The update engine's ``Reducer`` for many processes (D1, D2).

``DDPReducer`` agrees the window's denominator over ranks before the forward (so each
numerator is pre-scaled by ``R / D_global`` and DDP's average yields the global
objective's gradient, D1, D5), makes the finite and no-objective decisions one for
all ranks (D2, L4), and keeps DDP from syncing until a window's last microbatch.
Design and derivations: docs/design/parallel.md#parallelreducerpy (D1, D2, D5, L4).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn

from exactstep.errors import DistributedError
from exactstep.parallel.process_group import DistContext, host_group, peer_failure
from exactstep.update.window import LocalReducer


class DDPReducer:
    """Cross-rank sums and gradient-sync control over the default process group.

    Every call is a collective: every rank must make the same calls in the same
    order (the window guarantees it by running the same number of microbatches on
    every rank). A collective that fails or exceeds ``parallel.timeout_s`` (a dead
    peer) raises ``DistributedError``.
    """

    def __init__(self, ctx: DistContext) -> None:
        if not ctx.distributed:
            raise DistributedError("DDPReducer needs an initialised process group (world > 1)")
        self.ctx = ctx
        self.world_size = ctx.world_size
        # nccl reduces device tensors only; host tensors go over the host (gloo) group,
        # which carries the same parallel.timeout_s bound (process_group)
        self.comm_device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        self._host_group = host_group(ctx)
        self.collectives = 0  # how many sums this reducer issued (for tests and bench)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks of a small tensor, in one all-reduce.

        Host tensors are reduced on the host (U7: values known on the host, such as the
        window's planned ``[D, tokens]``, never visit a device, so reading the result
        is not a device sync); device tensors on ``comm_device``. Returns a new tensor
        on ``values``' device and dtype; ``values`` is not modified.
        """
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over ranks (used to agree on window lengths)."""
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def gather(self, obj: object) -> list:
        """Every rank's ``obj`` (small, picklable), in rank order, on every rank: one
        all-gather over the host group (a policy window's sample records, Q2)."""
        out: list = [None] * self.ctx.world_size
        try:
            dist.all_gather_object(out, obj, group=self._host_group)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise peer_failure(self.ctx, exc) from None
        self.collectives += 1
        return out

    def _all_reduce(self, values: torch.Tensor, op) -> torch.Tensor:
        host = values.device.type == "cpu"
        device = torch.device("cpu") if host else self.comm_device
        buffer = values.detach().to(device, copy=True)
        try:
            dist.all_reduce(buffer, op=op, group=self._host_group if host else None)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise peer_failure(self.ctx, exc) from None
        self.collectives += 1
        return buffer.to(values.device)

    def no_sync(self, module: nn.Module, is_last: bool) -> AbstractContextManager:
        """Skip gradient synchronisation for this microbatch unless it is the last (D1).

        DDP: ``module.no_sync()``. FSDP2: ``set_requires_gradient_sync(False)`` for
        the microbatch, restored afterwards. A module that is neither syncs nothing
        by itself, so the context is empty.
        """
        if is_last:
            return contextlib.nullcontext()
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return module.no_sync()
        # FSDP2 shards the model inside the engine's TrainModule (not a wrapper around it)
        sharded = module if hasattr(module, "set_requires_gradient_sync") else getattr(
            module, "model", None)
        if hasattr(sharded, "set_requires_gradient_sync"):
            return _fsdp_no_sync(sharded)
        return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]


def build_reducer(ctx: DistContext):
    """``DDPReducer`` for a process group, the engine's ``LocalReducer`` otherwise."""
    if ctx.distributed:
        return DDPReducer(ctx)
    return LocalReducer()
