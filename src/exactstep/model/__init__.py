"""The built-in decoder, the attention that realises Batch visibility (R2, R3), and the
Hugging Face causal-LM adapter (H1).
Design and derivations: docs/design/model.md (R2, R3, R8, H1).
"""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "Decoder": "exactstep.model.decoder",
    "HFCausalLM": "exactstep.model.hf",
    "ModelConfig": "exactstep.model.config",
    "Visibility": "exactstep.model.attention",
    "attend": "exactstep.model.attention",
    "build_hf_model": "exactstep.model.hf",
    "build_model": "exactstep.model.decoder",
    "prepare_visibility": "exactstep.model.attention",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
