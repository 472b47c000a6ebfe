"""A second model trained inside the window's transaction (Q5, U3, U4).

``SecondModel`` owns a module's parameter groups (U6), optimizer and schedule. Within a
window its steps are tentative: ``begin`` snapshots its parameters and optimizer state,
each ``step`` reduces its gradient over ranks (D1), decides finiteness on the reduced
values (U3) and steps; ``commit`` advances its clock by the steps taken (U4), ``rollback``
restores the snapshot bit for bit. The window program calls ``commit`` only when the
window committed, so the two models' updates are one transaction: both, or neither.
Design and derivations: docs/design/update.md#updatesecondpy (Q5, U3, U4, D1).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from exactstep.errors import ConfigError
from exactstep.update.config import UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.schedule import build_schedule

#: Fault injection: the second model's gradient made NaN (``professor.fail_window``).
CAUSE_INJECTED = "INJECTED_FAULT"
CAUSE_NONFINITE_LOSS = "NONFINITE_LOSS"
CAUSE_NONFINITE_GRAD = "NONFINITE_GRAD_NORM"

#: ``loss_fn()`` -> ``(numerator, count)``: this rank's graph-connected loss sum and the
#: number of items it covers; the step divides by the count summed over ranks.
LossFn = Callable[[], tuple[torch.Tensor, float]]


class SecondModel:
    """``module`` trained by its own optimizer on ``update`` (its ``optimizer``, ``lr``,
    ``schedule``, ``warmup``, ``clip``, ``weight_decay``); ``total_steps`` is the
    schedule's horizon in its own steps. ``name`` prefixes its skip causes."""

    def __init__(self, module: nn.Module, update: UpdateConfig | None, *, total_steps: int,
                 name: str) -> None:
        if update is None:
            raise ConfigError(f"the {name} has no optimizer: a second model in the window's "
                              "transaction is trained by its own optimizer (Q5); give one")
        self.module = module
        self.name = name
        self.optimizer, self.groups = build_optimizer(module, update)
        self.schedule = build_schedule(update, total_windows=max(1, total_steps))
        self.clip = update.clip
        self.parameters = self.groups.parameters
        self.committed = 0  # steps committed (its schedule's clock)
        self.pending = 0  # tentative steps of the current window
        self._snapshot: tuple[list[torch.Tensor], dict] | None = None

    # -- the window's tentative steps -------------------------------------------------

    def begin(self) -> None:
        """Snapshot parameters and optimizer state before the window's first step."""
        self.pending = 0
        self._snapshot = ([p.detach().clone() for p in self.parameters],
                          copy.deepcopy(self.optimizer.state_dict()))

    def step(self, loss_fn: LossFn, reducer: Any, *, inject: bool = False) -> dict:
        """One tentative step on ``loss_fn``'s loss summed over ranks and divided by the
        global count. Returns ``{"loss", "grad_norm", "lr", "cause"}``; ``cause`` is None
        when it stepped, else the reason nothing stepped (the same on every rank)."""
        self.optimizer.zero_grad(set_to_none=True)
        numerator, count = loss_fn()
        world = getattr(reducer, "world_size", 1)
        totals = torch.tensor([float(count)], dtype=torch.float64)
        total = float(reducer.sum(totals)[0]) if world > 1 else float(count)
        if total == 0.0:
            return {"loss": None, "grad_norm": None, "lr": None, "cause": None, "empty": True}
        (numerator / total).backward()
        for p in self.parameters:
            if p.grad is None:  # a parameter this window's loss did not reach
                p.grad = torch.zeros_like(p)
        if inject:
            self.parameters[0].grad.view(-1)[0] = float("nan")
        loss_sum_t = numerator.detach().reshape(1).float()
        if world > 1:  # D1: every rank's gradient and loss summed, one collective
            flat = torch.cat([p.grad.reshape(-1).float() for p in self.parameters]
                             + [loss_sum_t])
            flat = reducer.sum(flat.to(getattr(reducer, "comm_device", flat.device)))
            flat = flat.to(loss_sum_t.device)
            offset = 0
            for p in self.parameters:
                n = p.numel()
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype)
                offset += n
            loss_sum_t = flat[-1:]
        norm = get_total_norm([p.grad for p in self.parameters], 2.0).float()
        norm_value, loss_sum = torch.cat([norm.reshape(1), loss_sum_t]).tolist()  # one read
        loss = loss_sum / total
        if inject or not (math.isfinite(norm_value) and math.isfinite(loss_sum)):
            cause = (CAUSE_INJECTED if inject else
                     CAUSE_NONFINITE_LOSS if not math.isfinite(loss_sum) else
                     CAUSE_NONFINITE_GRAD)
            self.optimizer.zero_grad(set_to_none=True)
            return {"loss": loss, "grad_norm": norm_value, "lr": None,
                    "cause": f"{self.name.upper()}_{cause}"}
        if self.clip > 0:
            clip_grads_with_norm_(self.parameters, self.clip, norm)
        lr = self.schedule.lr_at(self.schedule.clock_value + self.pending)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending += 1
        return {"loss": loss, "grad_norm": norm_value, "lr": lr, "cause": None}

    def commit(self) -> None:
        """The window committed: its steps stand and the clock advances by them (U4)."""
        for _ in range(self.pending):
            self.schedule.advance(0)
        self.committed += self.pending
        self.pending = 0
        self._snapshot = None

    def rollback(self) -> None:
        """The window did not commit: parameters and optimizer state as at ``begin``,
        bit for bit; the clock never moved (U4)."""
        if self._snapshot is not None:
            weights, optimizer_state = self._snapshot
            with torch.no_grad():
                for p, w in zip(self.parameters, weights, strict=True):
                    p.copy_(w)
            self.optimizer.load_state_dict(optimizer_state)
        self.optimizer.zero_grad(set_to_none=True)
        self.pending = 0
        self._snapshot = None

    def frozen(self, *, at_start: bool = False) -> dict[str, torch.Tensor]:
        """The module's parameters as detached tensors for another model's step (no
        gradient can reach them): the current ones, or those at ``begin``."""
        if at_start and self._snapshot is not None:
            by_id = {id(p): w for p, w in zip(self.parameters, self._snapshot[0], strict=True)}
            return {n: by_id.get(id(p), p).detach() for n, p in self.module.named_parameters()}
        return {n: p.detach() for n, p in self.module.named_parameters()}

    # -- state (S2) -------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"weights": {k: v.detach().clone() for k, v in self.module.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict(), "committed": self.committed}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.committed = int(state["committed"])
        self.pending = 0
        self._snapshot = None
