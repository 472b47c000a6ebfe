"""Pipeline parallel: one ``torch.distributed.pipelining`` schedule step per window
(D1, D2, U1, U3).

``PipelineRunner`` is the update engine's window runner on one pipeline rank: the
window's K microbatches are the schedule's microbatches (GPipe, 1F1B, interleaved
1F1B over a ``StageModel``'s stages), each last-stage loss ``S_m * R / D_global`` with
the schedule's own ``1 / n_microbatches`` off, a tied embedding's two copies summed, the
clip norm summed over every stage; the layout's reducer agrees the finite flag over
every rank (one decision, D2). Families that need the whole model are refused.
Design and derivations: docs/design/parallel.md#parallelpipelinepy (D1, D2, U1, U3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm

from exactstep.errors import ConfigError, DistributedError
from exactstep.parallel.agreement import empty_microbatch
from exactstep.parallel.process_group import DistContext, peer_failure
from exactstep.parallel.reducer import DDPReducer
from exactstep.rows.batch import IGNORE_INDEX, Batch, held_out_batches
from exactstep.rows.transfer import host_to_device

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def pipeline_stages(schedule: str, pp: int, pp_rank: int) -> tuple[list[int], int]:
    """``(the stages pp_rank runs, the pipeline's stage count)``: ``pp_rank`` alone, or
    (interleaved, in loop order) ``pp_rank, pp_rank + pp, ...``."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}; "
                          f"got {schedule!r}")
    per_rank = STAGES_PER_RANK[schedule]
    return [pp_rank + pp * v for v in range(per_rank)], pp * per_rank


def refuse_pipeline(family: str, *, compiled: bool, program: object, inputs: object,
                    scored: bool = False) -> None:
    """One ``ConfigError`` line naming what to change for what a pipeline cannot run: a
    family with sequence-level inputs (rollouts, rewritten inputs, a second model) or an
    end-of-run score (greedy decoding): they read the whole model in one process; or
    ``train.compile``."""
    why = ("its windows run rollouts or a second model" if program is not None else
           "its inputs are rewritten from the model's own predictions" if inputs is not None
           else "its end-of-run score decodes greedily" if scored else None)
    if why is not None:
        raise ConfigError(
            f"parallel.pp > 1 is not available for objective.family = {family!r} ({why}, "
            "which needs the whole model in each process); set parallel.pp = 1")
    if compiled:
        raise ConfigError("parallel.pp > 1 runs its stages uncompiled; set train.compile = false")


def refuse_split_stages(layout) -> None:
    """A pipeline whose stages are themselves split (``tp`` or ``cp`` > 1) is not built:
    one ``DistributedError`` line naming the axes to set."""
    if layout.pp > 1 and (layout.tp > 1 or layout.cp > 1):
        raise DistributedError(
            f"parallel.pp = {layout.pp} with parallel.tp = {layout.tp} / parallel.cp = "
            f"{layout.cp} is not built: a pipeline stage here is whole layers on one "
            "process; set parallel.tp = parallel.cp = 1")


@dataclass
class _Microbatch:
    inputs: object  # the StageModel's StageInputs
    labels: torch.Tensor  # [B, T] on the device
    coeff: torch.Tensor  # [B, T] fp32 on the device
    rows_index: torch.Tensor | None


class _Stage(nn.Module):
    """One stage as the schedule's ``nn.Module``: ``index`` (a one-element host tensor,
    the microbatch) selects the host-planned inputs (no device read)."""

    def __init__(self, model: nn.Module, stage: int, runner: PipelineRunner) -> None:
        super().__init__()
        self.parts = nn.ModuleList(model.stage_modules(stage))  # its parameters
        self.stage = stage
        self._owner = (model, runner)  # not submodules

    def forward(self, *hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        model, runner = self._owner
        mb = runner.current[int(index[0])]
        with runner.autocast():
            return model.run_stage(self.stage, hidden[0] if hidden else None, mb.inputs)


class PipelineRunner:
    """The window runner of one pipeline rank (U1, U2, D1, D2).

    ``run`` prepares every microbatch's inputs here (every stage holds the same
    batches), then one ``schedule.step``: the last stage's loss of microbatch ``m`` is
    ``precision.scale(S_m * loss_scale)``, ``loss_scale = R / D_global`` planned before
    the forward, with ``scale_grads=False``: the schedule's default divides the stage
    module's gradients by its microbatch count (a per-microbatch mean), which is not
    the window objective. A window shorter than ``n_microbatches`` is padded with empty
    microbatches (zero coefficients: exact zeros added, U1). With tied embeddings the
    two copies' gradients are summed after the step. ``grad_norm`` is
    ``sqrt(sum over stages of |g_stage|^2)``, each logical parameter once.
    """

    scale_grads = False  # never the schedule's own 1 / n_microbatches (see ``_loss``)

    def __init__(self, model: nn.Module, *, schedule: str, n_microbatches: int, group,
                 device: torch.device, objective_cfg, pad_id: int, terms, precision,
                 rows: int, seq_len: int, tied_group=None, replica_group=None) -> None:
        from torch.distributed import pipelining

        self.model = model
        self.group = group
        self.device = device
        self.objective_cfg = objective_cfg
        self.pad_id = pad_id
        self.terms = terms
        self.precision = precision
        self.autocast = precision.autocast
        self.n_microbatches = n_microbatches
        self.shape = (rows, seq_len)
        self.tied_group = tied_group
        self.replica_group = replica_group  # this stage's data replicas (None: one)
        self.current: list[_Microbatch] = []
        # microbatch -> detached (S_m, NLL sum); keyed: a stage's first step may also
        # evaluate microbatch 0 to infer its shapes
        self._terms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loss_scale = 0.0
        stages = [pipelining.PipelineStage(_Stage(model, s, self), s, model.n_stages, device,
                                           group=group) for s in model.stages]
        kinds = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                 "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B}
        try:
            self.schedule = kinds[schedule](
                stages if schedule == "interleaved_1f1b" else stages[0], n_microbatches,
                loss_fn=self._loss, scale_grads=self.scale_grads)
        except ValueError as exc:
            said = " ".join(str(exc).split()).rstrip(".")
            raise ConfigError(f"parallel.schedule = {schedule!r}: {said}; raise update.accum "
                              "(the window's microbatches are the schedule's)") from None

    def run(self, engine, batches: Sequence[Batch], coefficients: Sequence[torch.Tensor],
            row_indices: Sequence[torch.Tensor | None], loss_scale: float, window: int
            ) -> tuple[list[torch.Tensor], list[torch.Tensor], dict | None]:
        self.current = [self._prepare(b, c, r) for b, c, r in
                        zip(*self._padded(batches, coefficients, row_indices), strict=True)]
        self._loss_scale = loss_scale
        self._terms = {}
        index = torch.arange(self.n_microbatches)  # chunk m of it is [m] (host)
        try:
            self.schedule.step(index=index, target=index, return_outputs=False)
            if self.model.tied:
                self._sum_tied_gradient()
            if self.replica_group is not None:
                self._mean_over_replicas()
        except dist.DistBackendError as exc:
            raise peer_failure(engine.reducer.ctx, exc) from None
        finally:
            self.current = []
        if not self._terms:  # not the last stage: it adds 0 to the agreed S and NLL
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            return [zero], [zero], None
        terms = [self._terms[m] for m in sorted(self._terms)]
        return [t[0] for t in terms], [t[1] for t in terms], None

    def evaluate(self, batches: Iterable[Batch], max_tokens: int,
                 byte_lengths: np.ndarray | None = None) -> tuple[float, int, int | None]:
        """Held-out gold NLL (L5, E1) through the schedule, forward only: the batches
        ``exactstep.eval.evaluate`` would read (those with targets, until ``max_tokens``
        targets), ``n_microbatches`` per schedule step; the sum, all-reduced from the
        last stage, is the same on every process. ``(NLL sum, targets, target bytes)``."""
        picked = list(held_out_batches(batches, max_tokens, byte_lengths))
        chosen = [batch for batch, _, _ in picked]
        tokens = sum(n for _, n, _ in picked)
        target_bytes = sum(spelled for _, _, spelled in picked)
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        k = self.n_microbatches
        for start in range(0, len(chosen), k):
            group = chosen[start:start + k]
            coeff = [(b.labels != IGNORE_INDEX).to(torch.float32) for b in group]
            self.current = [self._prepare(b, c, r) for b, c, r in
                            zip(*self._padded(group, coeff, [None] * len(group)), strict=True)]
            self._terms = {}
            index = torch.arange(k)
            try:
                with torch.no_grad():
                    self.schedule.eval(index=index, target=index)
            finally:
                self.current = []
            for m in range(len(group)) if self._terms else ():
                total += self._terms[m][1].double()
        dist.all_reduce(total, group=self.group)  # the last stage's sum, everywhere
        return float(total[0]), tokens, target_bytes if byte_lengths is not None else None

    def _loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Microbatch ``target[0]``'s ``S_m * R / D_global`` (scaled for fp16): its share
        of the window objective, never the schedule's per-microbatch mean."""
        m = int(target[0])
        mb = self.current[m]
        extra = {} if mb.rows_index is None else {"rows_index": mb.rows_index}
        with self.autocast():
            numerator, gold = self.terms(hidden, self.model.head_weight, mb.labels, mb.coeff,
                                         self.objective_cfg, pad_id=self.pad_id, **extra)
        self._terms[m] = (numerator.detach(), gold.detach())
        return self.precision.scale(numerator * self._loss_scale)

    def _padded(self, batches, coefficients, row_indices):
        for b in batches:
            if tuple(b.input_ids.shape) != self.shape:
                raise ConfigError(
                    f"pipeline microbatches must all be [batch.rows, batch.seq_len] = "
                    f"{list(self.shape)}; got {list(b.input_ids.shape)}: a batch compiler "
                    "with variable shapes cannot be pipelined; set parallel.pp = 1")
        pad = self.n_microbatches - len(batches)
        if pad < 0:
            raise ConfigError(f"a window of {len(batches)} microbatches exceeds the pipeline's "
                              f"{self.n_microbatches} (update.accum)")
        empty = [empty_microbatch(*self.shape, self.pad_id) for _ in range(pad)]
        return (list(batches) + empty,
                list(coefficients) + [torch.zeros(self.shape, dtype=torch.float32)] * pad,
                list(row_indices) + [None] * pad)

    def _prepare(self, batch: Batch, coeff: torch.Tensor, rows_index: torch.Tensor | None
                 ) -> _Microbatch:
        inputs = self.model.prepare(batch, self.device)
        return _Microbatch(inputs, inputs.batch.labels, host_to_device(coeff, self.device),
                           None if rows_index is None else host_to_device(rows_index,
                                                                          self.device))

    def _sum_tied_gradient(self) -> None:
        """Stage 0's embedding gradient plus the last stage's head gradient, on both:
        the gradient of the one tied parameter of the one-process model."""
        if not (self.model.holds_first or self.model.holds_last):
            return
        weight = self.model.embed.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self.tied_group)

    def _mean_over_replicas(self) -> None:
        """Each replica's stage gradient (pre-scaled by ``R / D_global``) averaged over
        the ``R`` replicas of this stage: the global window gradient (D1, as DDP's
        average), the head's and a tied copy's included. One all-reduce of one flat
        buffer per window."""
        params = list(self.model.parameters())
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.replica_group)
        flat.div_(dist.get_world_size(self.replica_group))
        for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
            p.grad.copy_(g.view_as(p.grad))

    def grad_norm(self, engine) -> torch.Tensor:
        """The whole model's gradient norm: this rank's squared norm summed over the
        pipeline (each logical parameter once: the tied copy is not counted here)."""
        grads = [p.grad for p in self.model.norm_parameters() if p.grad is not None]
        local = (get_total_norm(grads, 2.0).float() if grads else
                 torch.zeros((), dtype=torch.float32, device=self.device))
        squared = (local * local).reshape(1)
        try:
            dist.all_reduce(squared, group=self.group)
        except (RuntimeError, dist.DistBackendError) as exc:
            raise peer_failure(engine.reducer.ctx, exc) from None
        return squared[0].sqrt()


def tied_group(model: nn.Module, layout, group, timeout: timedelta | None = None):
    """The group of stage 0's and the last stage's ranks of this pipeline, or None
    without tied embeddings. Collective: every rank of the job creates every
    pipeline's pair, in the same order (``new_group``); two stages: the ``pp`` group."""
    if not model.tied:
        return None
    if layout.pp == 2:
        return group
    grid = layout.mesh.mesh  # [.., pp, ..] ranks
    lines = grid.movedim(layout.mesh.mesh_dim_names.index("pp"), -1).reshape(-1, layout.pp)
    mine = None
    for line in lines.tolist():  # each pipeline's ranks, stage by stage
        pair = [line[0], line[(model.n_stages - 1) % layout.pp]]
        created = dist.new_group(pair, timeout=timeout)
        if layout.rank in line:
            mine = created
    return mine


def pipeline_engine(engine, model: nn.Module, ctx: DistContext, *, schedule: str,
                    group=None, rows: int, seq_len: int):
    """Make ``engine`` (built on ``model``, a ``StageModel``) one pipeline rank: the
    layout's ``DDPReducer`` (``D`` summed over the data replicas, the finite flag and
    the reported sums over every rank, S and NLL from the last stage only: D1, D2) and
    a ``PipelineRunner`` of ``update.accum`` microbatches over ``group`` (default: the
    layout's ``pp`` group), its stage's gradients averaged over the ``dp`` replicas;
    returns it."""
    layout = ctx.layout
    if not ctx.distributed or layout.pp < 2:
        raise DistributedError("parallel.pp > 1 needs one process per stage; launch "
                               "parallel.pp processes (--nproc, torchrun)")
    refuse_split_stages(layout)
    group = group if group is not None else layout.group("pp")
    timeout = timedelta(seconds=ctx.timeout_s) if ctx.timeout_s else None
    engine.reducer = DDPReducer(ctx)
    engine.runner = PipelineRunner(
        model, schedule=schedule, n_microbatches=engine.update_cfg.accum, group=group,
        device=ctx.device, objective_cfg=engine.objective_cfg,
        pad_id=engine.train_module.pad_id, terms=engine.train_module.terms,
        precision=engine.precision, rows=rows, seq_len=seq_len,
        tied_group=tied_group(model, layout, group, timeout), replica_group=layout.group("dp"))
    return engine
