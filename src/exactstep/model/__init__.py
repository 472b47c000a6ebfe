"""The built-in decoder and the attention that realises Batch visibility (R2, R3)."""

from exactstep.lazy import lazy_exports

_EXPORTS = {
    "Decoder": "exactstep.model.decoder",
    "ModelConfig": "exactstep.model.config",
    "Visibility": "exactstep.model.attention",
    "attend": "exactstep.model.attention",
    "build_model": "exactstep.model.decoder",
    "prepare_visibility": "exactstep.model.attention",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
