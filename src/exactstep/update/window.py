"""The window transaction: K microbatches -> exactly one disposition (U1-U4, U7).

``UpdateEngine.run_window`` (after a ``WindowProgram``'s rollouts, where a family has
one) plans the window on the host, backpropagates each
microbatch's numerator pre-scaled by ``1 / D_W`` at the same parameters, and closes in
the order of U3 with one host read (U7): committed, skipped as non-finite with
everything bitwise unchanged, or no objective. ``Reducer`` (D1, D2) and
``InputProgram`` and ``WindowProgram`` (R8, Q1) are where ranks and model-dependent
inputs plug in; ``WindowRunner`` where a pipeline's schedule takes over the
microbatches.
Design and derivations: docs/design/update.md#updatewindowpy (U1-U4, U7, D1, D2, R8).
Picture: docs/concepts/window.md.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from exactstep.objective import microbatch_terms, plan_window
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.types import NoObjective, NoObjectiveCause
from exactstep.rows.batch import Batch
from exactstep.rows.transfer import batch_to_device, host_to_device
from exactstep.update.config import UpdateConfig
from exactstep.update.disposition import Disposition, Outcome
from exactstep.update.precision import Precision
from exactstep.update.schedule import Schedule

PlanFn = Callable[[Sequence[Batch], ObjectiveConfig], Any]
TermsFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

CAUSE_NONFINITE_GRAD = "NONFINITE_GRAD_NORM"
CAUSE_NONFINITE_LOSS = "NONFINITE_LOSS"
CAUSE_INJECTED = "INJECTED_FAULT"  # update.fail_window
CAUSE_OTHER_RANK = "NONFINITE_ON_ANOTHER_RANK"


class InputProgram(Protocol):
    """Rewrites a microbatch's inputs from the model before its forward (R8).

    ``construct(model, host, device_batch, clock=, window=, autocast=)`` returns the
    batch to train on (labels unchanged) and a dict for the ledger; it must not
    create gradients and must depend only on its arguments (resume, S5).
    """

    def construct(self, model: nn.Module, host: Batch, device_batch: Batch, *, clock: int,
                  window: int, autocast: Callable[[], AbstractContextManager]
                  ) -> tuple[Batch, dict]: ...


class WindowProgram(Protocol):
    """Turns a window's batches into the batches it trains on, from the model at the
    window's parameters, before the window is planned (R8, Q1): rollouts.

    ``prepare(model, batches, clock=, window=, device=, reducer=)`` returns the batches
    to plan and train on and a dict for the ledger; it must not create gradients and must
    depend only on its arguments and its own state (resume, S5). ``close(disposition)``
    is told how the window ended (its state moves on commit only, U4);
    ``state_dict`` / ``load_state_dict`` are checkpointed with the engine (S2).

    A program that trains a second model in the window's transaction (Q5: Professor
    Forcing's discriminator) may also define ``train_module(model, objective_cfg,
    pad_id)``, the module whose ``forward(batch, coeff, rows_index)`` gives the
    micro-batch's ``(S_m, NLL sum)`` in place of ``TrainModule``'s, and
    ``skip_cause()``: after ``prepare``, the cause (the same on every rank) for which
    the window must end ``SKIPPED_NONFINITE`` before the model's forward, else None.

    A program that trains its batches by several optimizer steps (U3, U4: one
    transaction) defines ``next_pass(model, batches, step=, device=, reducer=)``: after
    the window's ``step``-th committed step, at the parameters it made, the batches of
    the next step and a dict for the ledger, or None when the window is done.
    """

    def prepare(self, model: nn.Module, batches: Sequence[Batch], *, clock: int, window: int,
                device: torch.device, reducer: Reducer) -> tuple[list[Batch], dict]: ...

    def close(self, disposition: Disposition) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class Reducer(Protocol):
    """Where cross-rank agreement plugs into the window (D1, D2).

    ``world_size`` is the number of data replicas and ``sum`` sums over them. A
    reducer whose ranks are not all whole replicas (tensor or pipeline shards) also
    defines ``agree`` (the sum over every rank: the finite flag, D2) and
    ``loss_owner`` (whether this rank's numerator counts in the reported sums); one
    without them is a job whose every rank is a replica (``agree`` is ``sum``).
    """

    world_size: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over the replicas (the same shape on each)."""
        ...

    def no_sync(self, module: nn.Module, is_last: bool) -> AbstractContextManager:
        """Context for one microbatch's forward+backward: skip gradient sync unless last."""
        ...


class LocalReducer:
    """One process: every reduction is the identity and there is nothing to sync."""

    world_size = 1
    loss_owner = True

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def agree(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def no_sync(self, module: nn.Module, is_last: bool) -> AbstractContextManager:
        return contextlib.nullcontext()


class WindowRunner(Protocol):
    """Runs a planned window's forward and backward at one set of parameters (U1, U2).

    ``run(engine, batches, coefficients, row_indices, loss_scale, window)`` leaves in
    the parameters' ``.grad`` the gradient of ``loss_scale * sum_m S_m`` over the
    window's microbatches and returns the detached ``S_m`` and gold NLL sums (one
    0-dim tensor each per microbatch this process computed; at least one, a 0 where it
    computed none) and the input program's ledger record (or None).
    ``grad_norm(engine)`` is the fp32 L2 norm of the whole model's gradient, each
    logical parameter counted once, the same on every rank that steps (clipping, D2).
    ``MicrobatchLoop`` is one process's (or one data replica's); a pipeline
    (``exactstep.parallel.pipeline``) hands the microbatches to its schedule.
    """

    def run(self, engine: UpdateEngine, batches: Sequence[Batch],
            coefficients: Sequence[torch.Tensor], row_indices: Sequence[torch.Tensor | None],
            loss_scale: float, window: int
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict | None]: ...

    def grad_norm(self, engine: UpdateEngine) -> torch.Tensor: ...


class MicrobatchLoop:
    """The engine's own window runner: microbatch after microbatch, each backpropagated
    as soon as it is evaluated, gradient sync on the last one only (D1)."""

    def run(self, engine: UpdateEngine, batches: Sequence[Batch],
            coefficients: Sequence[torch.Tensor], row_indices: Sequence[torch.Tensor | None],
            loss_scale: float, window: int
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict | None]:
        numerators: list[torch.Tensor] = []
        gold_sums: list[torch.Tensor] = []
        inputs_info: dict | None = None
        last = len(batches) - 1
        for index, batch in enumerate(batches):
            if engine.inputs is not None:  # every input rewritten before any gradient
                batch, info = engine._construct_inputs(batch, window)
                inputs_info = _merge_inputs_info(inputs_info, info)
            with engine.reducer.no_sync(engine.train_module, index == last):
                numerator, gold_nll_sum = engine._forward(
                    batch, coefficients[index], row_indices[index]
                )
                engine.precision.scale(numerator * loss_scale).backward()
            numerators.append(numerator.detach())
            gold_sums.append(gold_nll_sum.detach())
        return numerators, gold_sums, inputs_info

    def grad_norm(self, engine: UpdateEngine) -> torch.Tensor:
        return engine._grad_norm()


class TrainModule(nn.Module):
    """Model + objective as one module, so DDP can wrap the whole forward.

    ``forward(batch, coeff)`` returns ``(numerator, gold_nll_sum)``: the graph-
    connected 0-dim ``S_m = sum c_r * loss_r`` of the microbatch and the detached
    unsmoothed NLL sum (L3, L5). The model must return hidden states ``[B, T, H]``
    and expose ``head_weight`` ``[V, H]``; the objective fuses the head (L1).
    """

    def __init__(
        self,
        model: nn.Module,
        objective_cfg: ObjectiveConfig,
        *,
        pad_id: int,
        terms: TermsFn | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.objective_cfg = objective_cfg
        self.pad_id = pad_id
        self.terms = terms if terms is not None else _default_terms()

    def forward(
        self, batch: Batch, coeff: torch.Tensor, rows_index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(batch)  # [B, T, H]
        extra = {} if rows_index is None else {"rows_index": rows_index}
        return self.terms(
            hidden,
            head_for_loss(self.model),
            batch.labels,
            coeff,
            self.objective_cfg,
            pad_id=self.pad_id,
            **extra,
        )


def head_for_loss(model: nn.Module) -> torch.Tensor:
    """``model.head_weight`` ``[V, H]`` as the fused loss reads it (L1): under tensor
    parallel a ``DTensor`` sharded by vocabulary rows, gathered whole here (its
    backward keeps each rank's shard of the gradient, D5)."""
    weight = model.head_weight
    full_tensor = getattr(weight, "full_tensor", None)
    return full_tensor() if full_tensor is not None else weight


class UpdateEngine:
    """Runs windows as transactions and keeps the update-side progress (U1-U4, S2).

    Counters: ``committed``, ``skipped``, ``no_objective`` (windows),
    ``microbatches`` (evaluated or planned), ``tokens`` (supervised tokens of
    committed windows). ``state_dict`` holds optimizer, schedule, scaler and
    counters; the caller saves the model weights.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        precision: Precision,
        update_cfg: UpdateConfig,
        objective_cfg: ObjectiveConfig,
        *,
        device: torch.device | str,
        pad_id: int,
        reducer: Reducer | None = None,
        plan: PlanFn | None = None,
        terms: TermsFn | None = None,
        inputs: InputProgram | None = None,
        program: WindowProgram | None = None,
    ) -> None:
        self.model = model
        self.inputs = inputs
        self.program = program
        self.optimizer = optimizer
        self.schedule = schedule
        self.precision = precision
        self.update_cfg = update_cfg
        self.objective_cfg = objective_cfg
        self.device = torch.device(device)
        self.reducer: Reducer = reducer if reducer is not None else LocalReducer()
        self.plan = plan if plan is not None else _default_plan()
        make_module = getattr(program, "train_module", None)  # a second model's objective
        self.train_module: nn.Module = (
            make_module(model, objective_cfg, pad_id) if make_module is not None else
            TrainModule(model, objective_cfg, pad_id=pad_id, terms=terms))
        self.runner: WindowRunner = MicrobatchLoop()  # the window's forward and backward
        # Unique parameters (U6): the optimizer's groups list each tensor once.
        self.parameters = [p for group in optimizer.param_groups for p in group["params"]]
        self.committed = 0
        self.skipped = 0
        self.no_objective = 0
        self.microbatches = 0
        self.tokens = 0

    # -- the transaction ----------------------------------------------------------

    def run_window(self, batches: Sequence[Batch], window: int) -> Disposition:
        """Evaluate ``batches`` (host tensors, 1..K of them) and commit, skip or pass.

        A window shorter than ``update.accum`` (the end of the data) is a window
        like any other (U1). Exactly one host read happens on the hot path (U7).
        ``NO_OBJECTIVE`` (``D_W == 0`` over the window and all ranks) touches nothing,
        not even the scaler; ``SKIPPED_NONFINITE`` leaves parameters, optimizer state
        and step count and the schedule bitwise unchanged and backs the scaler off (U4).
        """
        if not batches:
            raise ValueError("run_window needs at least one microbatch")
        self.microbatches += len(batches)
        program_info = None
        if self.program is not None:  # rollouts at the window's parameters (Q1)
            batches, program_info = self.program.prepare(
                self.model, batches, clock=self.committed, window=window, device=self.device,
                reducer=self.reducer)
            skip_cause = getattr(self.program, "skip_cause", None)
            cause = skip_cause() if skip_cause is not None else None
            passes = getattr(self.program, "next_pass", None)
            disposition = (self._skip_unplanned(batches, window, cause, program_info)
                           if cause is not None else
                           self._run_passes(batches, window, program_info)
                           if passes is not None else
                           self._run_planned(batches, window, program_info))
            self.program.close(disposition)
            return disposition
        return self._run_planned(batches, window, None)

    def _run_planned(self, batches: Sequence[Batch], window: int,
                     program_info: dict | None) -> Disposition:
        # 1. plan: D_W known before the forward; agreed over ranks (U1, L4, D1)
        plan = self._plan(batches)
        denominator, tokens, signal = self._global_totals(*_plan_totals(plan))
        if denominator == 0.0 or signal == 0.0:
            self.no_objective += 1
            return Disposition(
                window=window,
                outcome=Outcome.NO_OBJECTIVE,
                cause=_no_objective_cause(plan, tokens, signal, denominator),
                lr=None,
                denominator=0.0,
                loss=None,
                grad_norm=None,
                tokens=0,
                microbatches=len(batches),
                inputs=program_info,
            )
        coefficients, row_indices = _microbatch_inputs(plan, batches)

        # 2. microbatches at the same parameters; one loss scale for the window (U1, U2)
        loss_scale = self._loss_scale(denominator)  # 1 / D_W, times R under DDP (D1)
        numerators, gold_sums, inputs_info = self.runner.run(
            self, batches, coefficients, row_indices, loss_scale, window)
        injected = self.update_cfg.fail_window == window
        if injected:
            self._inject_nonfinite_gradient()

        # 3. close, in the order of U3
        self.precision.unscale_(self.optimizer)
        grad_norm = self.runner.grad_norm(self)  # fp32, each parameter once, computed once
        numerator_sum = torch.stack(numerators).sum().float()
        local_bad = ~(torch.isfinite(grad_norm) & torch.isfinite(numerator_sum))
        gold_sum = torch.stack(gold_sums).sum().float()
        if not getattr(self.reducer, "loss_owner", True):  # a shard whose S another reports
            numerator_sum, gold_sum = torch.zeros_like(numerator_sum), torch.zeros_like(gold_sum)
        # [norm, flag, S, NLL]; a reducer that reduces on the host (gloo) takes it there
        # first: that copy is then the window's one device read, the collective a host op
        packed = torch.stack([grad_norm, local_bad.float(), numerator_sum, gold_sum])
        packed = packed.to(getattr(self.reducer, "comm_device", packed.device))
        agree = getattr(self.reducer, "agree", self.reducer.sum)  # over every rank (D2)
        agreed = agree(packed[1:])  # one all-reduce of flag + report values
        # U7: the window's single device-to-host read (a no-op copy if already on the host)
        norm_value, bad_ranks, numerator_total, gold_total = torch.cat(
            [packed[:1], agreed]
        ).tolist()
        loss = numerator_total / denominator
        finite = bad_ranks == 0.0

        lr_used: float | None = None
        if finite:
            if self.update_cfg.clip > 0:
                clip_grads_with_norm_(self._with_grad(), self.update_cfg.clip, grad_norm)
            lr_used = self._set_lr(self.schedule.lr())
            self.optimizer.step()
            self.precision.update(self.optimizer, finite=True)
            self.schedule.advance(tokens)
            self.committed += 1
            self.tokens += tokens
            outcome, cause = Outcome.COMMITTED, None
        else:
            self.precision.update(self.optimizer, finite=False)
            self.skipped += 1
            outcome = Outcome.SKIPPED_NONFINITE
            cause = _skip_cause(injected, norm_value, numerator_total)
        self.optimizer.zero_grad(set_to_none=True)
        return Disposition(
            window=window,
            outcome=outcome,
            cause=cause,
            lr=lr_used,
            denominator=denominator,
            loss=loss,
            grad_norm=norm_value,
            tokens=tokens,
            gold_nll_sum=gold_total,
            microbatches=len(batches),
            inputs=inputs_info if program_info is None else program_info,
        )

    def _run_passes(self, batches: Sequence[Batch], window: int,
                    program_info: dict | None) -> Disposition:
        """Several optimizer steps on one window, as one transaction (U3, U4): the first
        on ``batches``, each next on the batches ``next_pass`` gives at the parameters
        the last step made. A non-finite step undoes every step of the window bit for
        bit (parameters, optimizer, schedule, scaler, counters) and the window is
        ``SKIPPED_NONFINITE``; a step with no objective is not taken and ends the steps.
        The disposition's figures are the first step's; ``steps`` lists each step's."""
        saved = self._snapshot()
        steps = [self._run_planned(batches, window, program_info)]
        while steps[-1].outcome is Outcome.COMMITTED:
            following = self.program.next_pass(self.model, batches, step=len(steps),
                                               device=self.device, reducer=self.reducer)
            if following is None:
                break
            steps.append(self._run_planned(following[0], window, following[1]))
        first, last = steps[0], steps[-1]
        if len(steps) == 1:
            return first
        records = tuple(_step_record(i, d) for i, d in enumerate(steps))
        if last.outcome is Outcome.SKIPPED_NONFINITE:  # every step undone (U4)
            self._restore(saved)
            self.precision.update(self.optimizer, finite=False)
            self.skipped += 1
            return replace(first, outcome=Outcome.SKIPPED_NONFINITE, cause=last.cause,
                           lr=None, steps=records)
        if last.outcome is Outcome.NO_OBJECTIVE:  # a step with no gradient, not taken
            self.no_objective -= 1
        return replace(first, steps=records)

    def _snapshot(self) -> tuple[list[torch.Tensor], dict]:
        """Parameters and the engine's state (optimizer, schedule, scaler, counters),
        copied: what a window of several steps restores when it does not commit."""
        state = {key: value for key, value in self.state_dict().items() if key != "program"}
        return [p.detach().clone() for p in self.parameters], copy.deepcopy(state)

    def _restore(self, saved: tuple[list[torch.Tensor], dict]) -> None:
        weights, state = saved
        with torch.no_grad():
            for p, w in zip(self.parameters, weights, strict=True):
                p.copy_(w)
        program, self.program = self.program, None  # the program's state is its own
        try:
            self.load_state_dict(copy.deepcopy(state))
        finally:
            self.program = program
        self.optimizer.zero_grad(set_to_none=True)

    def _skip_unplanned(self, batches: Sequence[Batch], window: int, cause: str,
                        program_info: dict | None) -> Disposition:
        """The program found a non-finite value before the forward (Q5, U3): the window
        is skipped as any non-finite one is, the model untouched; the loss scaler too
        (the value was not this model's gradient overflowing)."""
        self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)
        return Disposition(window=window, outcome=Outcome.SKIPPED_NONFINITE, cause=cause,
                           lr=None, denominator=0.0, loss=None, grad_norm=None, tokens=0,
                           microbatches=len(batches), inputs=program_info)

    # -- steps of the transaction ---------------------------------------------------

    def _construct_inputs(self, batch: Batch, window: int) -> tuple[Batch, dict]:
        """The input program's microbatch, built at the window's parameters on the
        committed clock (windows committed before this one)."""
        device_batch = batch_to_device(batch, self.device)
        return self.inputs.construct(self.model, batch, device_batch, clock=self.committed,
                                     window=window, autocast=self.precision.autocast)

    def _global_totals(self, denominator: float, tokens: int, signal: float
                       ) -> tuple[float, int, float]:
        """Window denominator, supervised tokens and signal (``sum |a_r|``, where a plan
        reports one) summed over ranks (host values)."""
        if self.reducer.world_size == 1:
            return denominator, tokens, signal
        # Host values, known before the forward: summed as a host tensor over a host-
        # capable group (a collective, not a device sync; U7). The read is of host memory.
        summed = self.reducer.sum(torch.tensor([denominator, float(tokens), signal],
                                               dtype=torch.float64))
        total_denominator, total_tokens, total_signal = summed.tolist()
        return total_denominator, int(total_tokens), total_signal

    def _loss_scale(self, denominator: float) -> float:
        """Pre-scale of every numerator: ``R / D_global``. DDP averages the gradient
        over the ``R`` ranks, so ``R`` restores the sum and ``1 / D_global`` normalizes
        the window objective (U1, D1). One process: ``1 / D_W``."""
        return self.reducer.world_size / denominator

    def _plan(self, batches: Sequence[Batch]) -> Any:
        """The objective stage's host-side plan. With several ranks a locally empty
        window is still planned (zero coefficients): L4 is decided globally (D1)."""
        if self.reducer.world_size > 1:
            return self.plan(batches, self.objective_cfg, allow_empty=True)
        return self.plan(batches, self.objective_cfg)

    def _forward(
        self, batch: Batch, coeff: torch.Tensor, rows_index: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # pinned and asynchronous on CUDA: no host wait per microbatch (U7)
        batch = batch_to_device(batch, self.device)
        coeff = host_to_device(coeff, self.device)  # [B, T] fp32
        if rows_index is not None:
            rows_index = host_to_device(rows_index, self.device)  # [N_supervised]
        with self.precision.autocast():
            return self.train_module(batch, coeff, rows_index)

    def _with_grad(self) -> list[nn.Parameter]:
        return [p for p in self.parameters if p.grad is not None]

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters if p.grad is not None]

    def _grad_norm(self) -> torch.Tensor:
        grads = self._grads()
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        norm = get_total_norm(grads, 2.0)
        full_tensor = getattr(norm, "full_tensor", None)
        if full_tensor is not None:
            # FSDP2 (D4): the norm of sharded (DTensor) gradients is a partial value per
            # rank; reducing it counts each logical parameter exactly once.
            norm = full_tensor()
        return norm.float()

    def _inject_nonfinite_gradient(self) -> None:
        """Fault injection (``update.fail_window``): one gradient entry becomes NaN."""
        for param in self.parameters:
            if param.grad is not None:
                grad = param.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2 shard
                if local.numel():
                    local.view(-1)[0] = float("nan")
                    return

    def _set_lr(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    # -- state (S2) -------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return {
            "committed": self.committed,
            "skipped": self.skipped,
            "no_objective": self.no_objective,
            "microbatches": self.microbatches,
            "tokens": self.tokens,
        }

    def state_dict(self) -> dict:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "precision": self.precision.state_dict(),
            "counters": self.counters(),
        }
        if self.program is not None:
            state["program"] = self.program.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.precision.load_state_dict(state["precision"])
        for name, value in state["counters"].items():
            setattr(self, name, int(value))
        if self.program is not None:
            self.program.load_state_dict(state["program"])


def _merge_inputs_info(total: dict | None, info: dict) -> dict:
    """One window's input-program record: counts summed over microbatches, the rest
    (the same for every microbatch of the window) taken once."""
    if total is None:
        return dict(info)
    return {key: total[key] + value if key.endswith("_inputs") else total[key]
            for key, value in info.items()}


def _step_record(index: int, d: Disposition) -> dict:
    """One optimizer step of a window of several (its ledger entry)."""
    record = {"step": index, "disposition": d.outcome.value, "cause": d.cause, "lr": d.lr,
              "loss": d.loss, "grad_norm": d.grad_norm}
    if index and d.inputs is not None:
        record["inputs"] = d.inputs
    return record


def _plan_totals(plan: Any) -> tuple[float, int, float]:
    """``(D, tokens, signal)``; a plan without a ``signal`` (every L3 reduction, whose
    coefficients are zero exactly where D gets nothing) reports D for it."""
    if isinstance(plan, NoObjective):
        return 0.0, 0, 0.0
    signal = getattr(plan, "signal", None)
    return (float(plan.denominator), int(plan.tokens),
            float(plan.denominator if signal is None else signal))


def _no_objective_cause(plan: Any, global_tokens: int, signal: float = 0.0,
                        denominator: float = 0.0) -> str:
    if isinstance(plan, NoObjective):
        return plan.cause.value
    # a plan with D == 0 (several ranks): the cause follows the global token count
    if global_tokens == 0:
        return NoObjectiveCause.EMPTY_ELIGIBLE_SET.value
    if denominator != 0.0 and signal == 0.0:  # every coefficient zero (Q4, L4)
        return NoObjectiveCause.ZERO_ADVANTAGE.value
    return NoObjectiveCause.NONEMPTY_ZERO_WEIGHT_MASS.value


def _microbatch_inputs(
    plan: Any, batches: Sequence[Batch]
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per-microbatch coefficients ``[B, T]`` and supervised-row indices (or None).

    A rank whose share has no objective while others do runs a graph-connected
    zero pass with zero coefficients (D1).
    """
    if isinstance(plan, NoObjective):
        zeros = [torch.zeros(b.labels.shape, dtype=torch.float32) for b in batches]
        return zeros, [None] * len(batches)
    indices = list(getattr(plan, "row_indices", None) or [None] * len(batches))
    return list(plan.coefficients), indices


def _skip_cause(injected: bool, norm: float, numerator: float) -> str:
    if injected:
        return CAUSE_INJECTED
    if not math.isfinite(numerator):
        return CAUSE_NONFINITE_LOSS
    if not math.isfinite(norm):
        return CAUSE_NONFINITE_GRAD
    return CAUSE_OTHER_RANK


def _default_plan() -> PlanFn:
    return plan_window


def _default_terms() -> TermsFn:
    return microbatch_terms
