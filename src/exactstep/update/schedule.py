"""Learning-rate schedules on a declared clock (U5).

``Schedule`` gives the rate of the next update as a pure function of a clock of
committed updates or committed supervised tokens, for the families constant, cosine,
wsd, noam and inverse_sqrt; only committed windows advance it, so a skipped or
no-objective window leaves it bitwise unchanged (U4). ``build_schedule`` sets the horizon.
Design and derivations: docs/design/update.md#updateschedulepy (U5, U4).
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
    resume continues bit for bit (S2). ``warmup`` is in clock units; ``noam`` and
    ``inverse_sqrt`` count a warmup of 0 as 1 and have no floor.
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
