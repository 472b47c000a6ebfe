"""Pipeline parallel: the built-in decoder split into stages, one schedule step per window
(D1, D2, U1, U3, S7).

``split_decoder`` keeps this rank's stages of a ``Decoder`` under their one-process
parameter names (``StageModel``; a tied embedding is copied to the last stage and its
gradient summed between the two); ``PipelineRunner`` is the update engine's window
runner: the window's K microbatches are the schedule's microbatches
(``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B), each last-stage loss
``S_m * R / D_global`` with the schedule's own ``1 / n_microbatches`` turned off, the
clip norm summed over every stage, the finite flag agreed by every rank.
Design and derivations: docs/design/parallel.md#parallelpipelinepy (D1, D2, U1, U3, S7).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import get_total_norm
from torch.utils.checkpoint import checkpoint

from exactstep.errors import ConfigError, DistributedError
from exactstep.model.attention import Visibility, prepare_visibility
from exactstep.model.decoder import Decoder, rope_tables
from exactstep.parallel.agreement import empty_microbatch
from exactstep.parallel.process_group import DistContext, peer_failure
from exactstep.parallel.reducer import DDPReducer
from exactstep.rows.batch import Batch
from exactstep.transfer import batch_to_device, host_to_device

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2}


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[lo, hi)`` of ``n_stages`` stages, as equal as can be
    (the first ``n_layers % n_stages`` stages one layer longer). Refused (``ConfigError``)
    when a stage would hold no layer."""
    if n_layers < n_stages:
        raise ConfigError(
            f"parallel.pp needs at least one layer per pipeline stage: {n_stages} stages, "
            f"model.n_layers = {n_layers}; lower parallel.pp (or use parallel.schedule = "
            "'1f1b', one stage per rank) or raise model.n_layers")
    base, extra = divmod(n_layers, n_stages)
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def stage_indices(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stages ``pp_rank`` runs: ``pp_rank`` alone, or (interleaved, loop order)
    ``pp_rank, pp_rank + pp, ...``."""
    return [pp_rank + pp * v for v in range(STAGES_PER_RANK[schedule])]


@dataclass
class _Microbatch:
    """What every stage of one microbatch reads besides the activations (host-planned)."""

    batch: Batch
    visibility: Visibility
    cos: torch.Tensor  # [B, T, 3, 1, Dh]
    sin: torch.Tensor
    coeff: torch.Tensor  # [B, T]
    rows_index: torch.Tensor | None


class StageModel(nn.Module):
    """This rank's stages of a ``Decoder``, under the one-process parameter names.

    ``embed`` on the rank of stage 0, ``layers.<i>`` for each layer ``i`` of its stages,
    ``final_norm`` and ``head`` on the rank of the last stage. With tied embeddings the
    last stage keeps a copy of ``embed`` as its head: the same name, the same value, the
    same gradient (summed between the two ranks after the backward), the same update,
    so the copies stay bitwise equal and a checkpoint holds one ``embed.weight``.
    """

    def __init__(self, decoder: Decoder, stages: Sequence[int],
                 bounds: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        self.cfg = decoder.cfg
        self.vocab_size = decoder.vocab_size
        self.stages = tuple(stages)
        self.n_stages = len(bounds)
        self.bounds = tuple(bounds)
        self.holds_first = 0 in self.stages
        self.holds_last = self.n_stages - 1 in self.stages
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for s in self.stages
                                     for i in range(*bounds[s])})
        self.tied_copy = False
        if self.holds_first:
            self.embed = decoder.embed
        if self.holds_last:
            self.final_norm = decoder.final_norm
            if decoder.head is not None:
                self.head = decoder.head
            elif not self.holds_first:  # the tied head: a copy of stage 0's embedding
                self.embed = copy.deepcopy(decoder.embed)
                self.tied_copy = True
        self.tied = decoder.head is None

    @property
    def head_weight(self) -> torch.Tensor:
        """``[V, H]`` on the last stage's rank (the embedding's copy when tied)."""
        return self.embed.weight if self.tied else self.head.weight

    def num_parameters(self) -> int:
        """This rank's parameters (a tied copy counted here too)."""
        return sum(p.numel() for p in self.parameters())

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank counts in the global gradient norm: all of its own,
        the tied copy not (stage 0 counts the embedding once)."""
        copy_id = id(self.embed.weight) if self.tied_copy else None
        return [p for p in self.parameters() if id(p) != copy_id]

    def check_rows(self, seq_len: int) -> None:
        """Rows of any length are exact (as the decoder's)."""

    def describe(self) -> None:
        return None


class _StagePart(nn.Module):
    """One pipeline stage's forward: ``index`` (a 1-element host tensor, the microbatch)
    selects the host-planned inputs; stage 0 embeds the tokens, the last stage ends with
    the final norm (hidden states: the loss fuses the head, L1)."""

    def __init__(self, model: StageModel, stage: int, runner: PipelineRunner) -> None:
        super().__init__()
        lo, hi = model.bounds[stage]
        self.first = stage == 0
        self.last = stage == model.n_stages - 1
        self.embed = model.embed if self.first else None
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in range(lo, hi))
        self.final_norm = model.final_norm if self.last else None
        self.recompute = model.cfg.activation_checkpointing
        self._runner = [runner]  # not a submodule

    def forward(self, *hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        runner = self._runner[0]
        mb = runner.current[int(index[0])]  # host tensor: no device read
        with runner.autocast():
            x = self.embed(mb.batch.input_ids) if self.first else hidden[0]  # [B, T, H]
            for block in self.blocks:
                if self.recompute and torch.is_grad_enabled():  # H5
                    x = checkpoint(block, x, mb.cos, mb.sin, mb.visibility, use_reentrant=False)
                else:
                    x = block(x, mb.cos, mb.sin, mb.visibility)
            return self.final_norm(x) if self.last else x


class PipelineReducer(DDPReducer):
    """The engine's reducer for a pipeline of one data replica (D1, D2): the stages hold
    the same batches, so the planned ``D`` and token count are already global
    (``world_size = 1``: the ``R`` of ``R / D``), and the window's one all-reduce of
    ``[flag, S, NLL]`` runs over every stage: the flag reaches them all (one finite
    decision, D2) and S, NLL come from the last stage only (the others add 0)."""

    def __init__(self, ctx: DistContext) -> None:
        super().__init__(ctx)
        self.world_size = 1


class PipelineRunner:
    """The window runner of one pipeline rank (U1, U2, D1, D2).

    ``run`` prepares every microbatch's inputs on this rank (the same batches on every
    stage), then one ``schedule.step``: the last stage's loss of microbatch ``m`` is
    ``precision.scale(S_m * loss_scale)`` with ``loss_scale = R / D_global`` planned
    before the forward, and ``scale_grads=False``, so the schedule does not divide the
    gradients by its microbatch count (its default assumes a per-microbatch mean). A
    window shorter than ``n_microbatches`` is padded with empty microbatches
    (zero coefficients: the gradient gains exact zeros, U1). With tied embeddings the
    two copies' gradients are summed after the step. ``grad_norm`` is
    ``sqrt(sum over stages of |g_stage|^2)``, each logical parameter once.
    """

    scale_grads = False  # the schedule's own 1 / n_microbatches: never (see ``_loss``)

    def __init__(self, model: StageModel, *, schedule: str, n_microbatches: int,
                 group, device: torch.device, objective_cfg, pad_id: int, terms,
                 autocast, precision, rows: int, seq_len: int, tied_group=None) -> None:
        from torch.distributed import pipelining

        self.model = model
        self.group = group
        self.device = device
        self.objective_cfg = objective_cfg
        self.pad_id = pad_id
        self.terms = terms
        self.autocast = autocast
        self.precision = precision
        self.n_microbatches = n_microbatches
        self.shape = (rows, seq_len)
        self.tied_group = tied_group
        self.current: list[_Microbatch] = []
        # microbatch -> detached (S_m, NLL sum); keyed, as the stage's first step may also
        # evaluate microbatch 0 to infer its shapes
        self._terms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._loss_scale = 0.0
        self.parts = [_StagePart(model, s, self) for s in model.stages]
        stages = [pipelining.PipelineStage(part, s, model.n_stages, device, group=group)
                  for part, s in zip(self.parts, model.stages, strict=True)]
        kinds = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
                 "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B}
        kind = kinds[schedule]
        try:
            self.schedule = kind(stages if schedule == "interleaved_1f1b" else stages[0],
                                 n_microbatches, loss_fn=self._loss,
                                 scale_grads=self.scale_grads)
        except ValueError as exc:
            raise ConfigError(f"parallel.schedule = {schedule!r}: {exc}; raise update.accum "
                              "(the window's microbatches are the schedule's)") from None

    # -- the window ---------------------------------------------------------------------

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
        except (RuntimeError, dist.DistBackendError) as exc:
            if isinstance(exc, dist.DistBackendError) or "failed to run" not in str(exc):
                raise peer_failure(engine.reducer.ctx, exc) from None
            raise
        finally:
            self.current = []
        if not self._terms:  # not the last stage: it adds 0 to the agreed S and NLL
            zero = torch.zeros((), dtype=torch.float32, device=self.device)
            return [zero], [zero], None
        terms = [self._terms[m] for m in sorted(self._terms)]
        return [t[0] for t in terms], [t[1] for t in terms], None

    def _loss(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Microbatch ``target[0]``'s ``S_m * R / D_global`` (scaled for fp16): the
        window objective's share, never the schedule's per-microbatch mean."""
        m = int(target[0])
        mb = self.current[m]
        with self.autocast():
            numerator, gold = self.terms(hidden, self.model.head_weight, mb.batch.labels,
                                         mb.coeff, self.objective_cfg, pad_id=self.pad_id,
                                         **({} if mb.rows_index is None
                                            else {"rows_index": mb.rows_index}))
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
        cfg = self.model.cfg
        head_dim = cfg.d_model // cfg.n_heads
        batch = batch_to_device(batch, self.device)
        cos, sin = rope_tables(batch.position_ids, head_dim, cfg.rope_theta)
        return _Microbatch(
            batch=batch,
            visibility=prepare_visibility(batch, cfg.attention, self.device, head_dim=head_dim),
            cos=cos, sin=sin, coeff=host_to_device(coeff, self.device),
            rows_index=None if rows_index is None else host_to_device(rows_index, self.device))

    def _sum_tied_gradient(self) -> None:
        """Stage 0's embedding gradient plus the last stage's head gradient, on both:
        the gradient of the one tied parameter of the one-process model."""
        if not (self.model.holds_first or self.model.holds_last):
            return
        weight = self.model.embed.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        dist.all_reduce(weight.grad, group=self.tied_group)

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


def refuse_pipeline(family: str, model: nn.Module, *, lora: bool, compiled: bool,
                    program: object, inputs: object) -> None:
    """One ``ConfigError`` line naming what to change for what a pipeline cannot split:
    a sequence-level family (its rollouts or rewritten inputs need the whole model in
    one process), a model other than the built-in decoder, LoRA, ``train.compile``."""
    if program is not None or inputs is not None:
        raise ConfigError(
            f"parallel.pp > 1 is not available for objective.family = {family!r} (its "
            "sequence-level inputs need the whole model in each process); set "
            "parallel.pp = 1")
    if not isinstance(model, Decoder):
        raise ConfigError(
            f"parallel.pp > 1 splits the built-in decoder only, not {type(model).__name__}; "
            "set parallel.pp = 1 or model.source = 'builtin'")
    if lora:
        raise ConfigError("parallel.pp > 1 does not split LoRA adapters; set model.lora.r = 0 "
                          "or parallel.pp = 1")
    if compiled:
        raise ConfigError("parallel.pp > 1 runs the stages uncompiled; set train.compile = false")


def split_decoder(decoder: Decoder, *, schedule: str, pp: int, pp_rank: int) -> StageModel:
    """This rank's ``StageModel`` of ``decoder`` (built whole from the seed, so every
    stage's weights are the one-process model's): ``STAGES_PER_RANK[schedule]`` stages
    of contiguous layers per rank."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}; "
                          f"got {schedule!r}")
    n_stages = pp * STAGES_PER_RANK[schedule]
    bounds = stage_bounds(decoder.cfg.n_layers, n_stages)
    return StageModel(decoder, stage_indices(schedule, pp, pp_rank), bounds)


def tied_group(model: StageModel, group):
    """The two-rank group of stage 0 and the last stage (collective: every rank of
    ``group`` calls it), or None without tied embeddings."""
    if not model.tied:
        return None
    ranks = dist.get_process_group_ranks(group)
    first, last = ranks[0], ranks[(model.n_stages - 1) % len(ranks)]
    return group if len(ranks) == 2 else dist.new_group([first, last])


def pipeline_engine(engine, model: StageModel, ctx: DistContext, *, schedule: str,
                    group=None, rows: int, seq_len: int):
    """Make ``engine`` (built on ``model``) one pipeline rank: the ``PipelineReducer``
    and the ``PipelineRunner`` of ``update.accum`` microbatches; returns it."""
    if not ctx.distributed:
        raise DistributedError("parallel.pp > 1 needs one process per stage; launch "
                               "parallel.pp processes (--nproc, torchrun)")
    group = group if group is not None else dist.group.WORLD
    engine.reducer = PipelineReducer(ctx)
    engine.runner = PipelineRunner(
        model, schedule=schedule, n_microbatches=engine.update_cfg.accum, group=group,
        device=ctx.device, objective_cfg=engine.objective_cfg,
        pad_id=engine.train_module.pad_id, terms=engine.train_module.terms,
        autocast=engine.precision.autocast, precision=engine.precision, rows=rows,
        seq_len=seq_len, tied_group=tied_group(model, group))
    return engine


__all__ = ["PipelineRunner", "StageModel", "pipeline_engine", "refuse_pipeline",
           "split_decoder", "stage_bounds"]

