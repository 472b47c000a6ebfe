"""Pipeline stages of the built-in decoder: contiguous layers, one-process names (L1, S7).

``split_decoder`` keeps the stages one process runs of a seeded ``Decoder`` as a
``StageModel`` whose parameters carry the one-process names (``embed.weight``,
``layers.3.attn.qkv.weight``, ``head.weight``), so checkpoints map by name across
layouts (S7); ``StageModel.prepare`` builds a microbatch's visibility and RoPE tables
once for all its stages and ``run_stage`` is one stage's forward (the last ends with the
final norm: the loss fuses the head, L1). ``exactstep.parallel.pipeline`` schedules them.
Design and derivations: docs/design/parallel.md#parallelpipelinepy (L1, S7).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from exactstep.errors import ConfigError
from exactstep.model.attention import Visibility, prepare_visibility
from exactstep.model.decoder import Decoder, rope_tables
from exactstep.rows.batch import Batch
from exactstep.rows.transfer import batch_to_device


def stage_bounds(n_layers: int, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[lo, hi)`` of ``n_stages`` stages, as equal as can be
    (the first ``n_layers % n_stages`` stages one layer longer). Refused (``ConfigError``)
    when a stage would hold no layer."""
    if n_layers < n_stages:
        raise ConfigError(
            f"a pipeline of {n_stages} stages needs at least {n_stages} layers, one per "
            f"stage; model.n_layers = {n_layers}: lower parallel.pp (or use parallel.schedule "
            "= '1f1b', one stage per process) or raise model.n_layers")
    base, extra = divmod(n_layers, n_stages)
    bounds, lo = [], 0
    for s in range(n_stages):
        hi = lo + base + (1 if s < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@dataclass
class StageInputs:
    """What every stage reads of one microbatch besides the activations."""

    batch: Batch  # on the device
    visibility: Visibility
    cos: torch.Tensor  # [B, T, 3, 1, Dh]
    sin: torch.Tensor


class StageModel(nn.Module):
    """The stages one process runs of a ``Decoder``, under the one-process names.

    ``embed`` with stage 0, ``layers.<i>`` for each layer ``i`` of its stages,
    ``final_norm`` and ``head`` with the last stage. With tied embeddings the last
    stage keeps a copy of ``embed`` as its head (``tied_copy``): the same name and
    value; the pipeline sums the two copies' gradients, so they take the same update
    and stay bitwise equal, and a checkpoint holds one ``embed.weight``.
    """

    def __init__(self, decoder: Decoder, stages: Sequence[int],
                 bounds: Sequence[tuple[int, int]]) -> None:
        super().__init__()
        self.cfg = decoder.cfg
        self.vocab_size = decoder.vocab_size
        self.stages = tuple(stages)
        self.bounds = tuple(bounds)
        self.n_stages = len(bounds)
        self.holds_first = 0 in self.stages
        self.holds_last = self.n_stages - 1 in self.stages
        self.tied = decoder.head is None
        self._whole = decoder.num_parameters()
        self.tied_copy = self.tied and self.holds_last and not self.holds_first
        self.layers = nn.ModuleDict({str(i): decoder.layers[i] for s in self.stages
                                     for i in range(*bounds[s])})
        if self.holds_first:
            self.embed = decoder.embed
        elif self.tied_copy:
            self.embed = copy.deepcopy(decoder.embed)
        if self.holds_last:
            self.final_norm = decoder.final_norm
            if not self.tied:
                self.head = decoder.head

    @property
    def head_weight(self) -> torch.Tensor:
        """``[V, H]`` with the last stage (the embedding's copy when tied)."""
        return self.embed.weight if self.tied else self.head.weight

    def num_parameters(self) -> int:
        """The whole model's unique parameters (what the run trains, as one process
        counts them), not this process's share."""
        return self._whole


    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters this process counts in the whole model's gradient norm: its
        own, the tied copy not (stage 0 counts the embedding once, U6)."""
        copied = id(self.embed.weight) if self.tied_copy else None
        return [p for p in self.parameters() if id(p) != copied]

    def check_rows(self, seq_len: int) -> None:
        """Rows of any length are exact (as the decoder's)."""

    def describe(self) -> None:
        """The configuration describes the model whole (as the decoder's)."""
        return None

    def prepare(self, batch: Batch, device: torch.device) -> StageInputs:
        """``batch``'s visibility and RoPE tables, once for every stage here."""
        head_dim = self.cfg.d_model // self.cfg.n_heads
        batch = batch_to_device(batch, device)  # pinned, asynchronous on CUDA (U7)
        cos, sin = rope_tables(batch.position_ids, head_dim, self.cfg.rope_theta)
        return StageInputs(batch, prepare_visibility(batch, self.cfg.attention, device,
                                                     head_dim=head_dim), cos, sin)

    def run_stage(self, stage: int, x: torch.Tensor | None, inputs: StageInputs
                  ) -> torch.Tensor:
        """Stage ``stage``'s forward: the embedded tokens (stage 0, ``x`` None) or ``x``
        ``[B, T, H]`` through its layers; the last stage's output is final-normed."""
        lo, hi = self.bounds[stage]
        if stage == 0:
            x = self.embed(inputs.batch.input_ids)  # [B, T, H]
        recompute = self.cfg.activation_checkpointing and self.training \
            and torch.is_grad_enabled()
        for i in range(lo, hi):
            block = self.layers[str(i)]
            if recompute:  # H5
                x = checkpoint(block, x, inputs.cos, inputs.sin, inputs.visibility,
                               use_reentrant=False)
            else:
                x = block(x, inputs.cos, inputs.sin, inputs.visibility)
        return self.final_norm(x) if stage == self.n_stages - 1 else x

    def stage_modules(self, stage: int) -> list[nn.Module]:
        """The modules whose parameters stage ``stage`` trains (for its ``nn.Module``)."""
        lo, hi = self.bounds[stage]
        modules: list[nn.Module] = [self.layers[str(i)] for i in range(lo, hi)]
        if stage == 0:
            modules.insert(0, self.embed)
        if stage == self.n_stages - 1:
            modules.append(self.final_norm)
        return modules


def split_decoder(model: nn.Module, *, stages: Sequence[int], n_stages: int) -> StageModel:
    """The ``StageModel`` of ``stages`` (of ``n_stages``) of ``model``, built whole from
    its seed so every stage's weights are the one-process model's. Refused
    (``ConfigError``) for any model but the built-in decoder without LoRA."""
    if not isinstance(model, Decoder):
        raise ConfigError(
            f"parallel.pp > 1 splits the built-in decoder only, not {type(model).__name__}; "
            "set parallel.pp = 1 or model.source = 'builtin'")
    if model.lora is not None:
        raise ConfigError("parallel.pp > 1 does not split LoRA adapters; set model.lora.r = 0 "
                          "or parallel.pp = 1")
    return StageModel(model, stages, stage_bounds(model.cfg.n_layers, n_stages))
