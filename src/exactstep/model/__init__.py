"""The built-in decoder and the attention that realises Batch visibility (R2, R3)."""

from exactstep.model.attention import Visibility, attend, prepare_visibility
from exactstep.model.decoder import Decoder, build_model

__all__ = ["Decoder", "Visibility", "attend", "build_model", "prepare_visibility"]
