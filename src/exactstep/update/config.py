"""Configuration of the update stage (U1-U6) and of numerics (U2)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import POSITIVE_FLOAT32, UNIT, above, at_least, between, check

BETA = between(0, 1, high_open=True)  # [0, 1): a moving average that forgets


@dataclass(frozen=True, kw_only=True)
class UpdateConfig:
    """One window = ``accum`` microbatches -> at most one optimizer step.

    ``lr`` is the peak learning rate; ``schedule`` runs on ``clock`` (committed
    updates by default) with ``warmup`` units of that clock, decaying to
    ``min_lr_ratio * lr`` by ``decay_steps`` units of that clock. ``decay_steps = 0``
    means ``train.steps`` on the updates clock; on the tokens clock the horizon must be
    given in supervised tokens, because a run's supervised-token count is not known
    before it runs (padding, ownership and skipped windows decide it): a decaying
    family (``cosine``, ``wsd``) with ``clock = "tokens"`` and ``decay_steps = 0`` is
    refused here (U5). ``clip`` is the global L2 cap (0 = no clipping).
    ``weight_decay`` uses PyTorch's convention.

    ``optimizer``: ``adamw`` (``beta1``, ``beta2``, ``eps``), ``sgd`` (``momentum``)
    or ``adafactor`` (PyTorch's implementation: factored second moment, no first
    moment; ``beta1``/``eps`` unused). All use decoupled weight decay in PyTorch's
    convention, applied only to the ``decay`` group (U6).

    ``fail_window`` is fault injection for checking the skip path (U4): when it
    equals a window's index (0-based, counting every window), that window's
    gradient is made non-finite after its last backward, so the window ends
    ``SKIPPED_NONFINITE``. -1 (default) disables it. From the CLI:
    ``--set update.fail_window=N``.
    """

    accum: int = 1
    optimizer: Literal["adamw", "sgd", "adafactor"] = "adamw"
    lr: float = 6e-3
    min_lr_ratio: float = 0.1
    schedule: Literal["constant", "cosine", "wsd", "noam", "inverse_sqrt"] = "cosine"
    clock: Literal["updates", "tokens"] = "updates"
    warmup: int = 50
    decay_steps: int = 0
    decay_fraction: float = 0.2
    clip: float = 1.0
    weight_decay: float = 0.1
    decay_embeddings: bool = False
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9
    fail_window: int = -1

    def __post_init__(self) -> None:
        """Every value finite and in range; ``eps`` is added in float32, so it must be
        a positive normal float32 (a smaller one rounds to 0 and 0/0 is NaN)."""
        check("update.accum", self.accum, at_least(1))
        check("update.lr", self.lr, above(0))
        check("update.min_lr_ratio", self.min_lr_ratio, UNIT)
        check("update.warmup", self.warmup, at_least(0))
        check("update.decay_steps", self.decay_steps, at_least(0))  # 0 = train.steps
        if self.needs_token_horizon():
            raise ConfigError(token_horizon_message(self.schedule))
        check("update.decay_fraction", self.decay_fraction, UNIT)
        check("update.clip", self.clip, at_least(0))  # 0 = no clipping
        check("update.weight_decay", self.weight_decay, at_least(0))
        check("update.beta1", self.beta1, BETA)
        check("update.beta2", self.beta2, BETA)
        check("update.eps", self.eps, POSITIVE_FLOAT32)
        check("update.momentum", self.momentum, BETA)
        check("update.fail_window", self.fail_window, at_least(-1))  # -1 = off

    def needs_token_horizon(self) -> bool:
        """A decaying family on the tokens clock without a horizon in tokens (U5)."""
        return (
            self.clock == "tokens" and self.decay_steps == 0 and self.schedule in HORIZON_FAMILIES
        )


# Families whose learning rate depends on the horizon (the others never read it).
HORIZON_FAMILIES = ("cosine", "wsd")


def token_horizon_message(schedule: str) -> str:
    return (
        f"update.clock = 'tokens' with update.schedule = '{schedule}' needs its decay "
        "horizon in supervised tokens: set update.decay_steps to the number of committed "
        "supervised tokens by which the decay ends (update.decay_steps = 0 means "
        "train.steps only on update.clock = 'updates')"
    )


@dataclass(frozen=True, kw_only=True)
class NumericsConfig:
    """``precision``: fp32, bf16 (autocast, no scaler), fp16 (autocast + GradScaler), or
    ``auto``: bf16 on a CUDA device with native bf16, fp32 everywhere else (the CPU).

    ``fp32_matmul``: how fp32 matmuls run on CUDA: ``tf32`` (TensorFloat-32 inputs,
    fp32 accumulation), ``ieee`` (full fp32), or ``auto`` (``tf32`` on CUDA; the CPU
    always computes fp32 matmuls in fp32). ``init_scale`` is the fp16 loss scale at
    the start (GradScaler's default 65536).

    ``flush_denormal``: flush denormal floats to zero (x86's flush-to-zero and
    denormals-are-zero) on every thread that computes on the CPU. Arithmetic on
    denormals is many times slower, and AdamW's moments of rarely used parameters
    decay into them. It asks for a numerics environment, like ``train.threads``: what
    the run got is recorded (S9), a resume restores it, and a resume given another
    value is a declared, non-bitwise continuation.

    ``auto`` is a default, not a mode: a run resolves it for its device before the
    manifest is written (``resolve_numerics``), so the manifest records what ran and a
    resume keeps it whatever device it resumes on (S1, S4).
    """

    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    fp32_matmul: Literal["auto", "ieee", "tf32"] = "auto"
    init_scale: float = 65536.0
    flush_denormal: bool = True

    def __post_init__(self) -> None:
        check("numerics.init_scale", self.init_scale, POSITIVE_FLOAT32)  # a float32 scale


def resolve_numerics(cfg: NumericsConfig, device_type: str, *,
                     bf16_native: bool = True) -> NumericsConfig:
    """``cfg`` with every ``auto`` replaced by its value on ``device_type`` (U2).

    ``precision = auto``: ``bf16`` on ``cuda`` when ``bf16_native`` (the device has
    bf16 tensor cores), otherwise ``fp32``. ``fp32_matmul = auto``: ``tf32`` on
    ``cuda``, ``ieee`` elsewhere. Explicit values pass through unchanged, so resolving
    twice (a resume) is the identity.
    """
    cuda = device_type == "cuda"
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if cuda and bf16_native else "fp32"
    matmul = cfg.fp32_matmul
    if matmul == "auto":
        matmul = "tf32" if cuda else "ieee"
    return replace(cfg, precision=precision, fp32_matmul=matmul)
