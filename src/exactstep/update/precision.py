"""Mixed precision for one window (U2).

``Precision`` gives the update stage its autocast context (around the forward and the
loss only) and, under fp16, one loss scale per window, unscaled exactly once at the
close; ``auto`` resolves to bf16 on CUDA with native bf16 and fp32 elsewhere. The
parameters and gradients stay fp32, and the scaler follows the engine's finite decision.
Design and derivations: docs/design/update.md#updateprecisionpy (U2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from exactstep.update.config import NumericsConfig, resolve_numerics

_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}
# torch's names for the two fp32 matmul modes (its one consistent, global setting)
_FP32_MATMUL = {"tf32": "high", "ieee": "highest"}


def bf16_native(device_type: str) -> bool:
    """Whether ``device_type`` has native bf16 matmuls (CUDA: compute capability 8+)."""
    if device_type != "cuda":
        return False
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_device_numerics(cfg: NumericsConfig, device: torch.device | str) -> NumericsConfig:
    """``resolve_numerics`` for ``device``, asking the device whether bf16 is native."""
    device_type = torch.device(device).type
    return resolve_numerics(cfg, device_type, bf16_native=bf16_native(device_type))


def apply_fp32_matmul(cfg: NumericsConfig, device: torch.device | str) -> None:
    """Make fp32 matmuls on CUDA run as ``cfg.fp32_matmul`` says (process-wide).

    No-op off CUDA (CPU matmuls stay full fp32). Uses
    ``torch.set_float32_matmul_precision`` (``high`` = TF32, ``highest`` = IEEE fp32):
    the one setting that compiled kernels (FlexAttention, autotuning) read
    consistently; mixing it with the per-backend flags makes their reads fail.
    """
    if torch.device(device).type != "cuda":
        return
    mode = resolve_device_numerics(cfg, device).fp32_matmul
    torch.set_float32_matmul_precision(_FP32_MATMUL[mode])


class Precision:
    """Autocast context and loss scaler for one device and one ``numerics`` setting
    (``auto`` is resolved for ``device``; ``name`` is the resolved precision)."""

    def __init__(self, cfg: NumericsConfig, device: torch.device | str) -> None:
        self.name = resolve_device_numerics(cfg, device).precision
        self.device_type = torch.device(device).type
        self.scaler = torch.amp.GradScaler(
            self.device_type, init_scale=cfg.init_scale, enabled=self.uses_scaler
        )

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Wrap the forward and the loss (never the backward or the optimizer step)."""
        dtype = _AUTOCAST_DTYPE.get(self.name)
        if dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=dtype):
            yield

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` under fp16, ``loss`` otherwise (no host read)."""
        return self.scaler.scale(loss) if self.uses_scaler else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the accumulated gradients by the scale; once per window (U2)."""
        if self.uses_scaler:
            self.scaler.unscale_(optimizer)

    def update(self, optimizer: torch.optim.Optimizer, *, finite: bool) -> None:
        """Advance the scale after a decided window: back off when not ``finite``.

        Overrides the inf flags recorded by ``unscale_`` with the engine's decision
        (which may include other ranks or an injected fault), then lets
        ``GradScaler.update`` do its usual growth/back-off arithmetic.
        """
        if not self.uses_scaler:
            return
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        for flag in found.values():
            flag.fill_(0.0 if finite else 1.0)
        self.scaler.update()

    def current_scale(self) -> float:
        """The scale (a host read; for reports and tests, not the hot path)."""
        return float(self.scaler.get_scale()) if self.uses_scaler else 1.0

    def state_dict(self) -> dict:
        return {"precision": self.name, "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.uses_scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
