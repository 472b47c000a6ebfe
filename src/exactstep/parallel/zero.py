"""ZeRO-1: a ``zero1`` run's optimizer state sharded over the data replicas (D1, U4, U6).

``shard_optimizer`` rebuilds the engine's optimizer as PyTorch's
``ZeroRedundancyOptimizer`` over the same groups (``ShardedOptimizer``: its state dict
is this rank's shard, written through DCP); ``optimizer_state_bytes`` measures what a
rank holds. A room of its own so that importing ``torch.distributed.optim`` (0.7 s) is
paid by ``zero1`` jobs only.
Design: docs/design/parallel.md#parallelwrappy (D1, D4, U4, U6).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from exactstep.errors import DistributedError
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import DistContext


class ShardedOptimizer(ZeroRedundancyOptimizer):
    """PyTorch's ``ZeroRedundancyOptimizer`` whose ``state_dict`` is this rank's shard.

    ``param_groups`` are the whole groups (every parameter, the engine's clip set and
    its per-group ``lr``, synced into the shard's optimizer at each ``step``); ``optim``
    is the local optimizer over the parameters this rank owns. ``state_dict`` /
    ``load_state_dict`` are the local optimizer's (no collective): what the engine's
    snapshot of a window of several steps round-trips; a checkpoint writes every
    rank's shard through DCP (``dcp_format``), never a consolidated copy.
    """

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optim.load_state_dict(state_dict)
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def shard_params(self) -> list[nn.Parameter]:
        """The parameters whose state this rank keeps (and steps), group by group."""
        return [p for group in self.optim.param_groups for p in group["params"]]


def shard_optimizer(optimizer: torch.optim.Optimizer, ctx: DistContext,
                    cfg: ParallelConfig) -> torch.optim.Optimizer:
    """ZeRO-1: ``optimizer``'s class, groups and hyperparameters as a ``ShardedOptimizer``
    (``zero1`` with several processes); ``optimizer`` itself otherwise.

    The state is sharded over the data replicas (``ctx.layout``'s ``dp`` axis); a job
    of one replica keeps ``optimizer``. Call it before the first step (the state is
    empty). Each group keeps its
    ``name`` and ``weight_decay`` (U6); ``ZeroRedundancyOptimizer`` gives each
    parameter to one rank (largest first, to the least loaded rank) and, after the
    rank steps its shard with the whole averaged gradient, broadcasts it from there,
    so every replica holds the same bits. Raises ``DistributedError`` when the
    optimizer's defaults cannot be rebuilt by its class's constructor.
    """
    if not ctx.distributed or cfg.strategy != "zero1" or ctx.layout.dp == 1:
        return optimizer  # one data replica: nothing to shard the state over
    # over the data replicas (the job's default group when every rank is one)
    group = None if ctx.layout.only_data else ctx.layout.group("dp")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [dict(group) for group in optimizer.param_groups]
    sharded = ShardedOptimizer(groups, optimizer_class=cls, process_group=group, **kwargs)
    if sharded.optim.defaults != optimizer.defaults:
        raise DistributedError(
            f"parallel.strategy = 'zero1' could not rebuild {cls.__name__} with the same "
            "hyperparameters on each shard; use parallel.strategy = 'ddp'")
    return sharded


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state this rank holds: every tensor of its ``state``
    (a ``ShardedOptimizer``'s shard; an FSDP2 run's local shards of DTensor state)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    total = 0
    for state in local.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value = value.to_local() if hasattr(value, "to_local") else value
                total += value.numel() * value.element_size()
    return total
