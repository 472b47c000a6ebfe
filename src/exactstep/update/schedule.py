"""Learning-rate schedules on a declared clock (U5).

The clock is either ``updates`` (committed optimizer updates, the default) or
``tokens`` (committed supervised tokens). Only committed windows advance it: a
skipped or no-objective window leaves the schedule bitwise unchanged (U4).

With peak ``L = update.lr``, warmup ``W`` and horizon ``H`` (both in clock
units), clock value ``c`` and ``s = c + 1`` (the update about to be taken):

- ``constant``: ``L * min(1, s / W)`` (a linear warmup when ``W > 0``).
- ``cosine``: linear warmup, then ``L * (m + (1 - m) * (1 + cos(pi * p)) / 2)``
  with ``p = (c - W) / (H - W)`` clamped to ``[0, 1]`` and ``m = min_lr_ratio``.
- ``wsd`` (warmup-stable-decay): linear warmup, ``L`` until the last
  ``decay_fraction`` of ``H``, then linear to ``m * L`` at ``H``.
- ``noam``: ``L * min(s / W, sqrt(W / s))``; the Transformer paper's
  ``d^-0.5 * min(s^-0.5, s * W^-1.5)`` rescaled so that its peak (at ``s = W``) is
  ``L``.
- ``inverse_sqrt`` (T5 style): ``L * sqrt(W / max(s, W))``: flat at ``L`` for the
  first ``W`` units, then ``1/sqrt``. No ramp.

For ``noam`` and ``inverse_sqrt`` a ``W`` of 0 counts as 1; they have no floor.
"""

from __future__ import annotations

import math

from exactstep.errors import ConfigError
from exactstep.update.config import HORIZON_FAMILIES, UpdateConfig, token_horizon_message


class Schedule:
    """The learning rate as a pure function of the clock (U5).

    ``horizon`` is in clock units; ``None`` only for a family that never reads it.
    ``lr()`` is the rate for the next update; ``advance(tokens)`` is called once
    per committed window and only then. ``state_dict`` holds both clocks, so a
    resume continues bit for bit (S2).
    """

    def __init__(self, cfg: UpdateConfig, horizon: int | None) -> None:
        if horizon is None and cfg.schedule in HORIZON_FAMILIES:
            raise ConfigError(token_horizon_message(cfg.schedule))
        if horizon is not None and horizon < 1:
            raise ConfigError(f"the schedule horizon must be >= 1 {cfg.clock}; got {horizon}")
        self.family = cfg.schedule
        self.clock = cfg.clock
        self.peak_lr = cfg.lr
        self.min_ratio = cfg.min_lr_ratio
        self.warmup = cfg.warmup
        self.horizon = horizon
        self.decay_fraction = cfg.decay_fraction
        self.updates = 0
        self.tokens = 0

    @property
    def clock_value(self) -> int:
        return self.updates if self.clock == "updates" else self.tokens

    def lr(self) -> float:
        return self.lr_at(self.clock_value)

    def lr_at(self, c: int) -> float:
        """The rate for the update taken when the clock reads ``c``."""
        family = getattr(self, "_" + self.family)
        return float(family(c))

    def advance(self, committed_tokens: int) -> None:
        """One committed update consuming ``committed_tokens`` supervised tokens."""
        self.updates += 1
        self.tokens += int(committed_tokens)

    def state_dict(self) -> dict:
        return {"updates": self.updates, "tokens": self.tokens}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        self.tokens = int(state["tokens"])

    # -- families -------------------------------------------------------------

    def _ramp(self, c: int) -> float:
        if self.warmup <= 0:
            return 1.0
        return min(1.0, (c + 1) / self.warmup)

    def _constant(self, c: int) -> float:
        return self.peak_lr * self._ramp(c)

    def _cosine(self, c: int) -> float:
        if c < self.warmup:
            return self.peak_lr * self._ramp(c)
        progress = _clamp01((c - self.warmup) / max(1, self.horizon - self.warmup))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)

    def _wsd(self, c: int) -> float:
        if c < self.warmup:
            return self.peak_lr * self._ramp(c)
        decay_start = max(self.warmup, self.horizon - round(self.decay_fraction * self.horizon))
        if c < decay_start:
            return self.peak_lr
        progress = _clamp01((c - decay_start) / max(1, self.horizon - decay_start))
        # written so that the end of the decay is min_ratio exactly (no 1 - (1 - r) rounding)
        return self.peak_lr * (self.min_ratio + (1.0 - self.min_ratio) * (1.0 - progress))

    def _noam(self, c: int) -> float:
        w = max(1, self.warmup)
        s = c + 1
        return self.peak_lr * min(s / w, math.sqrt(w / s))

    def _inverse_sqrt(self, c: int) -> float:
        w = max(1, self.warmup)
        return self.peak_lr * math.sqrt(w / max(c + 1, w))


def build_schedule(cfg: UpdateConfig, total_windows: int) -> Schedule:
    """A ``Schedule`` whose decay horizon is ``update.decay_steps`` clock units (U5).

    ``decay_steps = 0`` means "the whole run" on the updates clock: ``total_windows``
    committed updates. On the tokens clock the horizon is ``decay_steps`` supervised
    tokens; a decaying family with ``decay_steps = 0`` there is refused with a
    ``ConfigError`` (``UpdateConfig`` already refuses it). The run's supervised-token
    count is not known before it runs, and an estimate in slots (rows x seq_len)
    overcounts by the padding and the unowned tokens, so the decay would never end.
    A family that never reads the horizon (``constant``, ``noam``, ``inverse_sqrt``)
    needs none on either clock.
    """
    if not 0.0 <= cfg.decay_fraction <= 1.0:
        raise ConfigError(f"update.decay_fraction must be in [0, 1]; got {cfg.decay_fraction}")
    if cfg.decay_steps > 0:
        return Schedule(cfg, cfg.decay_steps)
    if cfg.clock == "updates":
        return Schedule(cfg, max(1, total_windows))
    if cfg.needs_token_horizon():
        raise ConfigError(token_horizon_message(cfg.schedule))
    return Schedule(cfg, None)


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))
