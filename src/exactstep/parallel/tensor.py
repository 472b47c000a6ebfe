"""Tensor and sequence parallel through DTensor: a sharded operator is the dense one (D4, D5, U3).

``parallelize`` splits a replica's model over the layout's ``tp`` mesh with PyTorch's
``parallelize_module``: attention and MLP input projections column-sharded, their
output projections row-sharded, the norms sequence-parallel (the residual stream is
split over token rows between blocks, and a norm's weight gradient is summed over
every row by DTensor, U3). The built-in decoder's fused ``qkv`` and ``gate_up`` keep
their names and shapes; each is sharded *strided* so every rank holds whole heads of
q, k and v (and matching gate and up rows). The vocabulary tables are sharded by row
and gathered for the loss, which sees the whole head and the whole hidden states
(L1). ``gathered_state`` / ``scattered_state`` put strided tensors through
``torch.distributed.checkpoint`` by their logical names (S7).
Design and derivations: docs/design/parallel.md#paralleltensorpy (D4, D5, U3, S7).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exactstep.errors import ConfigError

#: the families whose programs generate with the model (rollouts, free-running
#: passes): their sampler runs the whole model on one rank
ROLLOUT_FAMILIES = ("policy", "professor", "scheduled_sampling")


def _styles():
    """PyTorch's parallel styles, and the two this module derives from them."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torch.distributed.tensor.placement_types import _StridedShard

    class FusedColwiseParallel(ColwiseParallel):
        """``ColwiseParallel`` for a weight ``[parts * n, in]`` holding ``parts`` fused
        projections: rank r keeps rows ``r`` of each part (``_StridedShard(0, parts)``),
        so the local output is ``[..., parts * n / tp]`` in the fused order, every part
        for the same heads. The output stays local (no redistribution to a plain
        ``Shard(-1)``, which would reorder it)."""

        def __init__(self, parts: int) -> None:
            super().__init__()
            self.parts = parts

        def _partition_linear_fn(self, name, module, device_mesh):
            for pname, param in list(module.named_parameters(recurse=False)):
                placement = [_StridedShard(0, split_factor=self.parts)]
                module.register_parameter(pname, nn.Parameter(distribute_tensor(
                    param, device_mesh, placement, src_data_rank=self.src_data_rank)))

        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()

    class GatheredSequenceParallel(SequenceParallel):
        """The final norm: sequence-parallel, then its output gathered whole to every
        rank as a plain tensor (the loss's input, L1)."""

        @staticmethod
        def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
            return outputs.redistribute(placements=[Replicate()]).to_local()

    return (Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel,
            PrepareModuleInput, FusedColwiseParallel, GatheredSequenceParallel)


def is_builtin_decoder(model: nn.Module) -> bool:
    """The built-in decoder itself (fused ``qkv`` / ``gate_up``), not a model built on
    its blocks with another forward (the two-stream decoder, the encoder-decoder)."""
    return type(model).__name__ == "Decoder" and hasattr(model, "layers")


def is_hf_causal_lm(model: nn.Module) -> bool:
    return type(model).__name__ == "HFCausalLM" and hasattr(model, "hf")


def check_divisible(model: nn.Module, tp: int) -> None:
    """Refuse, naming ``parallel.tp``, a model whose heads or MLP width ``tp`` does not
    divide (a rank must hold whole heads, D4), or one this module cannot split."""
    if is_builtin_decoder(model):
        cfg = model.cfg
        sizes = {"model.n_heads": cfg.n_heads, "model.d_ff": cfg.d_ff}
    elif is_hf_causal_lm(model) and hasattr(model.decoder, "layers"):
        c = model.hf.config
        sizes = {"num_attention_heads": c.num_attention_heads,
                 "num_key_value_heads": getattr(c, "num_key_value_heads", None)
                 or c.num_attention_heads,
                 "intermediate_size": c.intermediate_size}
        layer = model.decoder.layers[0]
        wanted = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "input_layernorm", "post_attention_layernorm")
        names = {name for name, _ in layer.named_modules()}
        missing = [w for w in wanted if w not in names]
        if missing or not hasattr(model.decoder, "embed_tokens") or not hasattr(
                model.decoder, "norm"):
            raise ConfigError(
                f"parallel.tp = {tp}: the {model.model_type} model is not Llama-shaped "
                f"(its decoder layer lacks {', '.join(missing) or 'embed_tokens/norm'}); "
                "tensor parallel splits the built-in decoder and Llama-family models; set "
                "parallel.tp = 1")
    else:
        raise ConfigError(f"parallel.tp = {tp}: tensor parallel splits the built-in decoder "
                          f"and Llama-family Hugging Face models only, not {type(model).__name__}"
                          "; set parallel.tp = 1")
    for name, size in sizes.items():
        if size % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide {name} = {size} (each "
                              "rank holds whole heads and MLP columns); choose a tp that "
                              "divides it")


def decoder_plan(model: nn.Module) -> dict[str, Any]:
    """The built-in decoder's plan: vocabulary-sharded embedding, column/row-sharded
    attention and MLP (fused ``qkv`` and ``gate_up`` strided), sequence-parallel norms,
    the residual stream split over token rows from the first block on."""
    (Replicate, Shard, _, Rowwise, SeqPar, Prepare, Fused, Gathered) = _styles()
    plan: dict[str, Any] = {
        "embed": Rowwise(input_layouts=Replicate(), output_layouts=Replicate()),
        "final_norm": Gathered(),
    }
    rest = (None, None, None)  # cos, sin, visibility: the whole rows, unchanged
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        if i == 0:  # the embedding's whole rows, split over tokens for the stream
            plan[p] = Prepare(input_layouts=(Replicate(), *rest),
                              desired_input_layouts=(Shard(1), *rest), use_local_output=True)
        plan.update({
            f"{p}.attn_norm": SeqPar(),
            f"{p}.attn": Prepare(input_layouts=(Shard(1), *rest),
                                 desired_input_layouts=(Replicate(), *rest)),
            f"{p}.attn.qkv": Fused(3),
            f"{p}.attn.out": Rowwise(output_layouts=Shard(1)),
            f"{p}.mlp_norm": SeqPar(),
            f"{p}.mlp": Prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.mlp.gate_up": Fused(2),
            f"{p}.mlp.down": Rowwise(output_layouts=Shard(1)),
        })
    return plan


def llama_plan(decoder: nn.Module) -> dict[str, Any]:
    """A Llama-family decoder stack's plan (relative to the stack): the same split as
    ``decoder_plan`` on separate q/k/v and gate/up projections."""
    (Replicate, Shard, Colwise, Rowwise, SeqPar, Prepare, _, Gathered) = _styles()
    plan: dict[str, Any] = {
        "embed_tokens": Rowwise(input_layouts=Replicate(), output_layouts=Replicate()),
        "norm": Gathered(),
    }
    for i in range(len(decoder.layers)):
        p = f"layers.{i}"
        if i == 0:
            plan[p] = Prepare(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                              use_local_output=True)
        plan.update({
            f"{p}.input_layernorm": SeqPar(),
            f"{p}.self_attn": Prepare(input_kwarg_layouts={"hidden_states": Shard(1)},
                                      desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            f"{p}.self_attn.q_proj": Colwise(),
            f"{p}.self_attn.k_proj": Colwise(),
            f"{p}.self_attn.v_proj": Colwise(),
            f"{p}.self_attn.o_proj": Rowwise(output_layouts=Shard(1)),
            f"{p}.post_attention_layernorm": SeqPar(),
            f"{p}.mlp": Prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.mlp.gate_proj": Colwise(),
            f"{p}.mlp.up_proj": Colwise(),
            f"{p}.mlp.down_proj": Rowwise(output_layouts=Shard(1)),
        })
    return plan


def shard_head(model: nn.Module, mesh) -> None:
    """An untied head's weight ``[V, H]`` sharded by vocabulary rows (``Shard(0)``): its
    parameters and optimizer state split over the ranks; the loss gathers it whole
    (``TrainModule``). A tied head is the embedding's table, sharded with it."""
    from torch.distributed.tensor import Shard, distribute_tensor

    head = model.hf.get_output_embeddings() if hasattr(model, "hf") else model.head
    if head is None or hasattr(head.weight, "placements"):
        return
    head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), mesh, [Shard(0)]))


def tied_head(model: nn.Module) -> bool:
    """Whether an HF model's head is its input embedding's Parameter (the built-in
    decoder's tied head is no module: ``head_weight`` reads the embedding)."""
    if not hasattr(model, "hf"):
        return False
    return model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """Split ``model`` over the one-dimensional ``tp`` mesh ``mesh`` in place (D4, D5, U3).

    Every parameter becomes a ``DTensor`` on ``mesh`` (sharded, or replicated for the
    norms), so the engine's clip norm counts each logical parameter once (U3, D4). The
    model's output is the whole final-normed hidden states ``[B, T, H]`` on every rank
    and ``head_weight`` a ``DTensor`` the loss gathers. Call it before the optimizer is
    built (and before FSDP2 on the ``dp`` mesh dimension)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    check_divisible(model, tp)
    if is_builtin_decoder(model):
        parallelize_module(model, mesh, decoder_plan(model))
    else:
        tied = tied_head(model)
        parallelize_module(model.decoder, mesh, llama_plan(model.decoder))
        if tied:  # the embedding's new (sharded) Parameter is the head's again (U6)
            model.hf.get_output_embeddings().weight = model.hf.get_input_embeddings().weight
    shard_head(model, mesh)
    return model


# ------------------------------------------------------------------ checkpoints (S7)


def _strided(value: Any) -> bool:
    """A ``DTensor`` strided on its last (``tp``) mesh dimension: a fused weight's
    shard. (FSDP2's own strided shards, on ``dp`` over a ``tp`` shard, are one block
    of the logical tensor, which the checkpoint describes as it is.)"""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = getattr(value, "placements", ())
    return bool(placements) and isinstance(placements[-1], _StridedShard)


def gathered_state(state: Any) -> Any:
    """``state`` (a nested state dict) with every strided-sharded ``DTensor`` gathered
    whole: a rank's strided shard is several row blocks of the logical tensor, which
    ``torch.distributed.checkpoint`` cannot describe as one chunk; whole, it is saved
    once under its logical name. Everything else is left as it is."""
    if isinstance(state, dict):
        return {k: gathered_state(v) for k, v in state.items()}
    if _strided(state):
        return state.full_tensor()
    return state


def scattered_state(loaded: Any, template: Any) -> Any:
    """The inverse of ``gathered_state``: where ``template`` holds a strided ``DTensor``,
    ``loaded`` (its whole value) is split back into this rank's shard (no
    communication: every rank holds the whole value)."""
    from torch.distributed.tensor import distribute_tensor

    if isinstance(template, dict):
        return {k: scattered_state(loaded[k], v) for k, v in template.items()}
    if _strided(template):
        return distribute_tensor(loaded.to(template.dtype), template.device_mesh,
                                 template.placements, src_data_rank=None)
    return loaded


def fsdp_placement(param: torch.Tensor):
    """FSDP2's ``shard_placement_fn`` over a split model (2-D ``dp x tp``): a fused
    weight, strided over ``tp`` on dim 0, is sharded over ``dp`` on dim 1. FSDP2's
    default dim 0 would nest a second stride inside the first, a layout ``DTensor``
    describes wrongly (its ``full_tensor`` and the checkpoint's offsets would permute
    rows; training itself gathers locally and is unaffected). Others: FSDP2's default."""
    from torch.distributed.tensor import Shard

    return Shard(1) if _strided(param) else None


def refuse_tensor_parallel(tp: int, *, family: str, lora: bool, compiled: bool,
                           strategy: str, dp: int) -> None:
    """``ConfigError`` for what tensor parallel does not run, before anything is written:
    a family that generates with the model, LoRA adapters, ``train.compile``, and DDP
    replicas of a split model (PyTorch's DDP takes no DTensor parameters)."""
    if tp == 1:
        return
    if family in ROLLOUT_FAMILIES:
        raise ConfigError(f"parallel.tp = {tp} does not run the {family} family (its rollouts "
                          "sample with the whole model on one rank); set parallel.tp = 1")
    if lora:
        raise ConfigError(f"parallel.tp = {tp} does not shard LoRA adapters (peft's layers "
                          "are not split by the tensor-parallel plan); set parallel.tp = 1 "
                          "or model.lora.r = 0")
    if compiled:
        raise ConfigError(f"parallel.tp = {tp} does not run a compiled model (the split "
                          "model's collectives are not compiled here); set train.compile = "
                          "false or parallel.tp = 1")
    if strategy == "ddp" and dp > 1:
        raise ConfigError(f"parallel.tp = {tp} with {dp} DDP replicas: PyTorch's DDP does not "
                          "replicate tensor-parallel (DTensor) parameters; set "
                          "parallel.strategy = 'fsdp' (FSDP2 over the replicas)")


def split_model(model: nn.Module, layout, *, family: str, lora: bool, compiled: bool,
                strategy: str) -> nn.Module:
    """``model`` split over ``layout``'s ``tp`` ranks (``parallelize``), after the
    refusals; unchanged when ``layout.tp == 1``."""
    refuse_tensor_parallel(layout.tp, family=family, lora=lora, compiled=compiled,
                           strategy=strategy, dp=layout.dp)
    if layout.tp == 1:
        return model
    return parallelize(model, layout.submesh("tp"))

