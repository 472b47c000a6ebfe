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
    """Cross-rank sums and gradient-sync control over the job's layout.

    ``world_size`` is the number of data replicas (``layout.dp``): the ``R`` of the
    engine's ``R / D_global`` pre-scale. ``sum`` and ``gather`` run over the replicas
    (every tensor, pipeline and sequence shard of one replica holds the same batches,
    so counting them would count a replica's tokens several times); ``agree`` and
    ``max`` over every rank (D2: one decision for the whole job). ``loss_owner`` says
    whether this rank's numerator counts in the reported sums (``Layout.loss_owner``).

    Every call is a collective: every rank must make the same calls in the same
    order (the window guarantees it by running the same number of microbatches on
    every rank). A collective that fails or exceeds ``parallel.timeout_s`` (a dead
    peer) raises ``DistributedError``.
    """

    def __init__(self, ctx: DistContext) -> None:
        if not ctx.distributed:
            raise DistributedError("DDPReducer needs an initialised process group (world > 1)")
        self.ctx = ctx
        layout = ctx.layout
        self.world_size = layout.dp
        self.loss_owner = layout.loss_owner
        # nccl reduces device tensors only; host tensors go over the host (gloo) group,
        # which carries the same parallel.timeout_s bound (process_group)
        self.comm_device = ctx.device if ctx.backend == "nccl" else torch.device("cpu")
        self._host_group = host_group(ctx)
        if layout.only_data:  # the replicas are the world: its groups
            self._replica_groups: tuple = (self._host_group, None)
        else:  # (None, None): one replica, nothing to sum over
            self._replica_groups = (layout.host_group("dp"), layout.group("dp"))
        self.collectives = 0  # how many sums this reducer issued (for tests and bench)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over the data replicas of a small tensor, in one all-reduce.

        Host tensors are reduced on the host (U7: values known on the host, such as the
        window's planned ``[D, tokens]``, never visit a device, so reading the result
        is not a device sync); device tensors on ``comm_device``. Returns a new tensor
        on ``values``' device and dtype; ``values`` is not modified.
        """
        host, device = self._replica_groups
        if self.world_size == 1 and not self.ctx.layout.only_data:
            return values.detach().clone()
        return self._all_reduce(values, dist.ReduceOp.SUM, host, device)

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over every rank of the job (the finite flag, D2, and the
        reported sums, which only ``loss_owner`` ranks contribute)."""
        return self._all_reduce(values, dist.ReduceOp.SUM, self._host_group, None)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over every rank (used to agree on window lengths)."""
        return self._all_reduce(values, dist.ReduceOp.MAX, self._host_group, None)

    def gather(self, obj: object) -> list:
        """Every replica's ``obj`` (small, picklable), in data-rank order, on every rank:
        one all-gather over the replicas' host group (a policy window's sample records,
        Q2)."""
        group = self._replica_groups[0]
        out: list = [None] * self.world_size
        if group is None:
            return [obj]
        try:
            dist.all_gather_object(out, obj, group=group)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise peer_failure(self.ctx, exc) from None
        self.collectives += 1
        return out

    def _all_reduce(self, values: torch.Tensor, op, host_group, device_group) -> torch.Tensor:
        host = values.device.type == "cpu"
        device = torch.device("cpu") if host else self.comm_device
        buffer = values.detach().to(device, copy=True)
        try:
            dist.all_reduce(buffer, op=op, group=host_group if host else device_group)
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
