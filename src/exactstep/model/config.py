"""Configuration of the built-in decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import POSITIVE_FLOAT32, at_least, check


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style decoder: RMSNorm, RoPE, SwiGLU, optional tied embedding/head.

    ``attention`` chooses how segment visibility is realised: ``auto`` (FlexAttention
    on CUDA, per-document SDPA on CPU), ``segments`` (per-document SDPA), ``dense``
    (one boolean mask, the reference) or ``flex`` (CUDA only).
    """

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 344
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: Literal["auto", "segments", "dense", "flex"] = "auto"

    def __post_init__(self) -> None:
        """Sizes >= 1; ``rope_theta``, ``norm_eps`` and ``init_std`` are realised in
        float32, so each must be a positive normal float32 (0, a negative value or one
        that rounds to 0 or infinity makes every window non-finite)."""
        for name in ("d_model", "n_layers", "n_heads", "d_ff"):
            check(f"model.{name}", getattr(self, name), at_least(1))
        for name in ("rope_theta", "norm_eps", "init_std"):
            check(f"model.{name}", getattr(self, name), POSITIVE_FLOAT32)
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError("model.d_model / model.n_heads must be even (RoPE rotates pairs)")
