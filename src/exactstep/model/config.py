"""Configuration of the model: the built-in decoder or a Hugging Face causal LM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from exactstep.errors import ConfigError
from exactstep.ranges import POSITIVE_FLOAT32, above, at_least, between, check


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters through ``peft`` (H4); ``r = 0`` (the default) means off.

    ``r`` is the adapter rank, ``alpha`` its scale numerator (``alpha / r``),
    ``dropout`` the probability on the adapter's input, ``target_modules`` a
    comma-separated list of module names (or ``all-linear``, every linear layer but the
    head). ``bias`` is ``none`` only: training a bias would move the base (H4).
    """

    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str = "all-linear"
    bias: Literal["none"] = "none"

    def __post_init__(self) -> None:
        """``r >= 0``, ``alpha > 0``, ``0 <= dropout < 1``, at least one target."""
        check("model.lora.r", self.r, at_least(0))
        check("model.lora.alpha", self.alpha, above(0))
        check("model.lora.dropout", self.dropout, between(0, 1, high_open=True))
        if not self.targets:
            raise ConfigError("model.lora.target_modules names no module")

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def targets(self) -> str | list[str]:
        """``target_modules`` as ``peft`` takes it: ``"all-linear"`` or a list of names."""
        names = [n.strip() for n in self.target_modules.split(",") if n.strip()]
        return "all-linear" if names == ["all-linear"] else names


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which model a run trains (``source``) and how it is built.

    ``source = "builtin"`` (the default): a Llama-style decoder, RMSNorm, RoPE,
    SwiGLU, optional tied embedding/head, sized by ``d_model`` .. ``init_std``.
    ``attention`` chooses how segment visibility is realised: ``auto``
    (FlexAttention on CUDA, per-document SDPA on CPU), ``segments`` (per-document
    SDPA), ``dense`` (one boolean mask, the reference) or ``flex`` (CUDA only).

    ``source = "hf"``: a Hugging Face causal LM (``exactstep.model.hf``, H1), from
    exactly one of ``path`` (a directory with ``config.json`` and safetensors weights)
    or ``hf_config`` (an HF config as a table with a ``model_type``, random init from
    the run's seed). ``attn_implementation`` is the HF attention backend (``sdpa``,
    ``eager``, or ``exactstep``: per-document attention without a dense mask); ``auto``
    (the default) is ``exactstep`` where the model allows it, else ``sdpa`` (``eager``
    without it), resolved from the model's config when it is built, with one line saying
    why; which backends can isolate packed documents is decided then too (R3).
    The built-in keys are then unused (but still recorded and validated).
    ``dtype`` is the parameters' dtype: ``float32`` (a bf16 or fp16 checkpoint is
    upcast exactly); ``bfloat16`` is refused (fp32 master weights, U2). ``lora``:
    adapters through ``peft`` (H4), on the built-in decoder or an HF model (the
    encoder-decoder and two-stream models refuse them).

    ``activation_checkpointing``: each block's activations are recomputed in the
    backward instead of kept, while training with gradients on (H5); the built-in
    decoder and HF models (the encoder-decoder and two-stream models refuse it).
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
    source: Literal["builtin", "hf"] = "builtin"
    path: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "auto"
    activation_checkpointing: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: LoRAConfig = field(default_factory=LoRAConfig)

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
        self._check_dtype()
        self._check_source()

    def _check_dtype(self) -> None:
        """Parameters are fp32 master weights (U2): ``bfloat16`` is refused, whatever
        the optimizer (docs/design/model.md#model-dtype)."""
        if self.dtype != "float32":
            raise ConfigError(
                f"model.dtype = {self.dtype!r} would hold the parameters and the optimizer "
                "state in bf16, where an update below half a bf16 step (2^-9 to 2^-8 of the "
                "weight) rounds away and the committed update is not the declared one (U2); keep "
                "model.dtype = 'float32' (a bf16 checkpoint is upcast exactly) and set "
                "numerics.precision = 'bf16' to compute in bf16"
            )

    def _check_source(self) -> None:
        """``path`` and ``hf_config`` belong to ``source = "hf"``, which needs exactly one."""
        given = [name for name in ("path", "hf_config") if getattr(self, name)]
        if self.source == "builtin":
            if given:
                raise ConfigError(
                    f"model.{given[0]} is set but model.source = 'builtin'; set "
                    "model.source = 'hf' to train a Hugging Face model"
                )
            return
        if len(given) != 1:
            what = "both" if given else "neither"
            raise ConfigError(
                f"model.source = 'hf' needs exactly one of model.path (a directory with "
                f"config.json and safetensors weights) or model.hf_config (a table with a "
                f"model_type); {what} given"
            )
        if self.hf_config and not isinstance(self.hf_config.get("model_type"), str):
            raise ConfigError(
                "model.hf_config needs a string model_type (e.g. 'llama', 'qwen2', 'gpt2')"
            )
