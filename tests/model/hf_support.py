"""Tiny Hugging Face causal LMs for the adapter tests, built from configs (no download).

``FAMILIES`` holds one small config per architecture (hidden 32, 2 layers, no
dropout); ``hf_model`` builds it through exactstep's ``build_model`` with
``model.source = "hf"``. Llama 4 and Mllama are the CausalLMs whose ``base_model``
is the CausalLM itself (the decoder stack is found another way, H1); Mllama's text
model has one cross-attention layer, which a text-only forward skips.
"""

from __future__ import annotations

from typing import Any

from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model

COMMON = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", **COMMON},
    "qwen2": {"model_type": "qwen2", **COMMON},
    "qwen3": {"model_type": "qwen3", **COMMON, "head_dim": 8},
    "mistral": {"model_type": "mistral", **COMMON},
    "gemma": {"model_type": "gemma", **COMMON, "head_dim": 8},
    "olmo2": {"model_type": "olmo2", **COMMON},
    "phi3": {"model_type": "phi3", **COMMON, "pad_token_id": 0},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama4": {"model_type": "llama4_text", **COMMON, "head_dim": 8,
               "intermediate_size_mlp": 64, "num_local_experts": 2},
    "mllama": {"model_type": "mllama", "text_config": {
        **COMMON, "num_hidden_layers": 3, "cross_attention_layers": [1], "pad_token_id": 0}},
}


def hf_config(family: str, **overrides: Any) -> dict[str, Any]:
    return {**FAMILIES[family], **overrides}


def hf_model_config(family: str, attn: str = "sdpa", **overrides: Any) -> ModelConfig:
    return ModelConfig(source="hf", hf_config=hf_config(family, **overrides),
                       attn_implementation=attn)


def hf_model(family: str, vocab: int, *, seed: int = 0, attn: str = "sdpa", **overrides: Any):
    return build_model(hf_model_config(family, attn, **overrides), vocab, seed=seed)


def perturb_saved_weight(model_dir: Any) -> None:
    """Add 1.0 to the first element of the first tensor (by name) of a saved HF model's
    ``model.safetensors``: the same architecture, other weights."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    weights = Path(model_dir) / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
