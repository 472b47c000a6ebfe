"""H5: ``model.activation_checkpointing`` recomputes each block in the backward and
changes no gradient.

On a packed batch through exactstep's chunked loss, gradients with and without
checkpointing are bitwise equal in fp32 on CPU (the recompute runs the same kernels on
the same inputs; measured exact, so asserted with ``torch.equal``), for the built-in
decoder and a tiny HF Llama. With dropout, the recompute replays the forward's masks.
That checkpointing happens is observed: blocks run again during the backward and
the tensors autograd keeps shrink. Each check has a negative control: a recompute
that differs from its forward, a recompute without the forward's RNG state, and a
flag that never reaches the forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hf_support import hf_model_config
from model_batches import packed_batch, random_documents
from torch import nn

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import Decoder, build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.terms import microbatch_terms
from exactstep.rows.batch import IGNORE_INDEX, Batch

VOCAB = 64
BUILTIN = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64)
#: dropout on attention probabilities (Llama) and on hidden states and attention (GPT-2)
DROPOUT = {"llama": {"attention_dropout": 0.3},
           "gpt2": {"resid_pdrop": 0.3, "embd_pdrop": 0.3, "attn_pdrop": 0.3}}


def packed() -> Batch:
    """Two rows of packed documents with a padded tail."""
    docs = random_documents(torch.Generator().manual_seed(0), [5, 9, 3, 7, 11, 4], VOCAB)
    return packed_batch([docs[:3], docs[3:]], 32)


def model_config(kind: str, checkpointing: bool, **hf: object) -> ModelConfig:
    cfg = BUILTIN if kind == "builtin" else hf_model_config(kind, **hf)
    return dataclasses.replace(cfg, activation_checkpointing=checkpointing)


def build(kind: str, checkpointing: bool, **hf: object) -> nn.Module:
    return build_model(model_config(kind, checkpointing, **hf), VOCAB, seed=0)


def gradients(model: nn.Module, batch: Batch, seed: int | None = None) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the token-mean loss, through exactstep's chunked
    fused loss (L1); with ``seed``, the global RNG (dropout) is seeded first."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    hidden = model(batch)  # [B, T, H]
    supervised = batch.labels != IGNORE_INDEX
    coeff = supervised.float() / supervised.sum()
    numerator, _ = microbatch_terms(hidden, model.head_weight, batch.labels, coeff,
                                    ObjectiveConfig(), pad_id=0)
    numerator.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def hf_layers(model: nn.Module) -> list[nn.Module]:
    """The HF decoder layers that checkpointing wraps."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


# ------------------------------------------------------------------ 1. same gradients


@pytest.mark.parametrize("kind", ["builtin", "llama"])
def test_checkpointed_gradients_are_bitwise_equal_h5(kind: str) -> None:
    """fp32 on CPU: exactly equal (measured 0.0 difference in every parameter)."""
    batch = packed()
    plain, checkpointed = build(kind, False), build(kind, True)
    reference = gradients(plain, batch)
    assert len(reference) == len(list(plain.parameters()))
    assert bitwise_equal(gradients(checkpointed, batch), reference)


class Drifting(nn.Module):
    """A block whose recompute differs from its forward by 1e-3 (a recompute that is
    not a replay): the negative control of the equality."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block, self.calls = block, 0

    def forward(self, *args: object) -> torch.Tensor:
        self.calls += 1
        out = self.block(*args)
        return out if self.calls % 2 else out * (1 + 1e-3)


def test_negative_control_a_recompute_that_drifts_is_caught_h5() -> None:
    batch = packed()
    reference = gradients(build("builtin", False), batch)
    model = build("builtin", True)
    assert isinstance(model, Decoder)
    model.layers = nn.ModuleList(Drifting(block) for block in model.layers)
    assert not bitwise_equal(gradients(model, batch), reference)
    assert all(block.calls == 2 for block in model.layers)  # forward, then recompute


# ------------------------------------------------------------ 2. dropout is replayed


@pytest.mark.parametrize("family", sorted(DROPOUT))
def test_recompute_replays_the_dropout_masks_h5(family: str) -> None:
    """Same RNG state before the step: the checkpointed gradients equal the plain ones
    bitwise, and dropout is live (another seed moves them)."""
    batch = packed()
    plain, checkpointed = build(family, False, **DROPOUT[family]), \
        build(family, True, **DROPOUT[family])
    assert plain.training and all(layer.training for layer in hf_layers(checkpointed))
    reference = gradients(plain, batch, seed=1)
    rng_after = torch.get_rng_state()
    assert not bitwise_equal(gradients(plain, batch, seed=2), reference)  # dropout draws
    assert bitwise_equal(gradients(checkpointed, batch, seed=1), reference)
    assert torch.equal(torch.get_rng_state(), rng_after)  # the recompute draws in a fork


@pytest.mark.parametrize("family", sorted(DROPOUT))
def test_negative_control_a_recompute_with_fresh_masks_is_caught_h5(family: str) -> None:
    """HF's checkpointing with ``preserve_rng_state=False``: the recompute draws new
    dropout masks, and the same comparison fails."""
    batch = packed()
    reference = gradients(build(family, False, **DROPOUT[family]), batch, seed=1)
    wrong = build(family, False, **DROPOUT[family])
    wrong.hf.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    assert not bitwise_equal(gradients(wrong, batch, seed=1), reference)


# ---------------------------------------------------------- 3. it really recomputes


def recomputed_calls(model: nn.Module, inner: Callable[[nn.Module], list[nn.Module]],
                     batch: Batch) -> int:
    """How many times modules of ``inner(model)`` start during the backward (a pre-hook:
    the recompute stops once it has what the backward needs, before later hooks)."""
    counter = {"backward": False, "calls": 0}

    def hook(module: nn.Module, args: object) -> None:
        counter["calls"] += counter["backward"]

    handles = [m.register_forward_pre_hook(hook) for m in inner(model)]
    try:
        model.zero_grad(set_to_none=True)
        hidden = model(batch)
        supervised = batch.labels != IGNORE_INDEX
        loss, _ = microbatch_terms(hidden, model.head_weight, batch.labels,
                                   supervised.float(), ObjectiveConfig(), pad_id=0)
        counter["backward"] = True
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return counter["calls"]


def saved_bytes(model: nn.Module, batch: Batch) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = model(batch)
        supervised = batch.labels != IGNORE_INDEX
        microbatch_terms(hidden, model.head_weight, batch.labels, supervised.float(),
                         ObjectiveConfig(), pad_id=0)
    return total[0]


def blocks(model: nn.Module) -> list[nn.Module]:
    """One inner module per block (module hooks on HF layers sit outside the
    checkpoint, so their MLPs are counted)."""
    if isinstance(model, Decoder):
        return [block.mlp for block in model.layers]
    return [layer.mlp for layer in hf_layers(model)]


@pytest.mark.parametrize("kind", ["builtin", "llama"])
def test_blocks_are_recomputed_and_fewer_activations_are_kept_h5(kind: str) -> None:
    batch = packed()
    plain, checkpointed = build(kind, False), build(kind, True)
    layers = len(blocks(plain))
    assert recomputed_calls(plain, blocks, batch) == 0
    assert recomputed_calls(checkpointed, blocks, batch) == layers  # each block once again
    assert saved_bytes(checkpointed, batch) < saved_bytes(plain, batch) / 2
    with torch.no_grad():  # nothing to recompute: checkpointing stays out of the way
        assert torch.equal(checkpointed(batch), plain(batch))


def test_negative_control_a_flag_that_never_reaches_the_forward_is_caught_h5() -> None:
    """A model built with the flag whose forward ignores it recomputes nothing and
    keeps as much as the plain model: both checks above would fail."""
    batch = packed()
    builtin = build("builtin", True)
    builtin.cfg = BUILTIN  # the forward reads a config without the flag
    hf = build("llama", True)
    hf.hf.activation_checkpointing_disable()
    for model, plain in ((builtin, build("builtin", False)), (hf, build("llama", False))):
        assert recomputed_calls(model, blocks, batch) == 0
        assert saved_bytes(model, batch) == saved_bytes(plain, batch)


def test_a_model_loaded_from_a_path_trains_in_train_mode_and_recomputes_h1_h5(tmp_path) -> None:
    """``from_pretrained`` leaves a model in eval mode (no dropout, no recompute); a run
    trains what it loaded in train mode, as it trains a model built from a config."""
    from transformers import AutoModelForCausalLM

    build("llama", False, attention_dropout=0.3).hf.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert not plain.training  # negative control: what transformers hands back
    cfg = ModelConfig(source="hf", path=str(tmp_path), activation_checkpointing=True)
    model = build_model(cfg, VOCAB, seed=0)
    assert all(module.training for module in model.modules())
    assert recomputed_calls(model, blocks, packed()) == len(blocks(model))


# ----------------------------------------------------------------- configuration


def test_the_key_defaults_off_and_reads_from_set() -> None:
    assert load_config().model.activation_checkpointing is False
    cfg = load_config(overrides=["model.activation_checkpointing=true"])
    assert cfg.model.activation_checkpointing is True
    with pytest.raises(ConfigError, match="model.activation_checkpointing"):
        load_config(overrides=["model.activation_checkpointing=3"])


def test_a_model_without_checkpointing_is_refused_naming_the_key(monkeypatch) -> None:
    from transformers import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_gradient_checkpointing", False)
    with pytest.raises(ConfigError, match="model.activation_checkpointing = false"):
        build("llama", True)
    build("llama", False)  # without the flag the same model builds


@pytest.mark.parametrize("family", ["encdec", "permutation"])
def test_models_that_do_not_recompute_refuse_the_flag(family: str) -> None:
    from exactstep.model.encdec import EncoderDecoder
    from exactstep.model.permutation import TwoStreamDecoder

    model = EncoderDecoder if family == "encdec" else TwoStreamDecoder
    with pytest.raises(ConfigError, match=f"{family}'\\); set model.activation_checkpointing"):
        model(model_config("builtin", True), VOCAB)
    model(model_config("builtin", False), VOCAB)
