"""Mixed precision for one window (U2).

- ``fp32``: no autocast, no scaler.
- ``bf16``: autocast around the forward and the loss only; no scaler.
- ``fp16``: autocast around the forward and the loss; one ``GradScaler`` scale for
  the whole window, ``unscale_`` exactly once at the window's close.

The parameters stay fp32 (autocast casts per op), so the gradients and the clip
norm are fp32. The window's own finite decision is the source of truth for the
scaler: ``update(finite)`` makes the scaler back off on exactly the windows the
engine skipped (and grow on the ones it committed), whatever the scaler's own
inf check saw.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from exactstep.update.config import NumericsConfig

_AUTOCAST_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast context and loss scaler for one device and one ``numerics`` setting."""

    def __init__(self, cfg: NumericsConfig, device: torch.device | str) -> None:
        self.name = cfg.precision
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
