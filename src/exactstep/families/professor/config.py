"""The ``[professor]`` section (Q5, R8): Professor Forcing, declared.

Light (no torch at import), so the run configuration can be read without loading the
training stack; the window program is ``forcing.py``, the discriminator
``discriminator.py``, the plan ``objective.professor``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import Range, at_least, between, check, check_finite

#: The bases whose model has a decoder that can run free (the sampler continues it).
DECODER_BASES = ("chat", "causal", "encdec")
ORDERS = ("d_then_g", "simultaneous")
OPTIMIZERS = ("adamw", "sgd")
COEFFICIENT = Range(0.0, note="a negative coefficient would train the generator to be told "
                          "apart; 0 turns the term off")


@dataclass(frozen=True, kw_only=True)
class ProfessorConfig:
    """Professor Forcing (Lamb et al., 2016) over a base family, every part declared.

    ``over``: the base family whose data and model are used (``chat``, ``causal`` or
    ``encdec``; any other is refused: it has no decoder to run free). Each example is
    split into prompt and reference response as the policy family splits it; the
    **teacher-forced path** reads prompt + reference, the **free-running path** prompt +
    one continuation drawn by the sampler (``generation.*``: temperature, top-k, top-p,
    ``max_new_tokens``; one sample per example, addressed ``(seed, window, example,
    0)``, eval mode, no gradients, Q1). The **behaviour** of a path is the generator's
    final hidden state at each response step (the state that predicts the step's
    token); ``compare``: ``response`` (each path's own steps) or ``common`` (the first
    ``min(n_forced, n_free)`` steps of both, so length alone cannot tell them apart).

    The **discriminator** (``d_hidden`` wide: a projection, a bidirectional GRU, an MLP
    on both final states) gives each behaviour sequence a logit ``z``, ``P(teacher-
    forced) = sigmoid(z)``. Its loss over the window's ``N`` examples is
    ``sum_tf softplus(-z) + sum_free softplus(z)``, divided by ``N``; its own optimizer
    (``d_optimizer``: ``adamw`` or ``sgd``), ``d_lr`` on its own ``d_schedule`` (warmup
    ``d_warmup``, clock: its committed steps), ``d_clip``, ``d_weight_decay``.

    The **generator's objective** is one S / D over the window (``D = N`` examples,
    every micro-batch and rank): ``S = sum_tf-tokens a_t (-log p) + lambda_free *
    sum_free softplus(-z) + lambda_forced * sum_tf softplus(z)``, ``a_t = 1``
    (``nll = "sequence_sum"``, the paper's) or ``1 / n`` (``"sequence_mean"``), ``z``
    from the discriminator with its parameters frozen (no gradient of the generator's
    step reaches it).

    ``order``: ``d_then_g`` (``d_steps`` discriminator steps on the window's
    trajectories, then the generator's step against the stepped discriminator) or
    ``simultaneous`` (both gradients at the window's start, ``d_steps = 1``). Both
    updates are one transaction (Q5): a non-finite value in either skips both.
    ``fail_window``: fault injection, the discriminator's gradient made NaN in that
    window (-1: off).
    """

    over: str = "chat"
    compare: Literal["response", "common"] = "response"
    lambda_free: float = 1.0
    lambda_forced: float = 0.0
    nll: Literal["sequence_sum", "sequence_mean"] = "sequence_sum"
    order: str = "d_then_g"
    d_steps: int = 1
    d_hidden: int = 32
    d_optimizer: str = "adamw"
    d_lr: float = 1e-3
    d_schedule: Literal["constant", "cosine"] = "constant"
    d_warmup: int = 0
    d_clip: float = 1.0
    d_weight_decay: float = 0.0
    fail_window: int = -1

    def __post_init__(self) -> None:
        for key in ("lambda_free", "lambda_forced"):
            check_finite(f"professor.{key}", getattr(self, key))
            check(f"professor.{key}", getattr(self, key), COEFFICIENT)
        if self.order not in ORDERS:
            raise ConfigError(f"professor.order must be one of {', '.join(ORDERS)}; got "
                              f"{self.order!r}")
        if self.d_optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"professor.d_optimizer = {self.d_optimizer!r}: the discriminator is trained "
                f"by its own optimizer; set one of {', '.join(OPTIMIZERS)}")
        check("professor.d_steps", self.d_steps, between(1, 64))
        if self.order == "simultaneous" and self.d_steps != 1:
            raise ConfigError("professor.order = 'simultaneous' takes both gradients at the "
                              f"window's start: set professor.d_steps = 1 (got {self.d_steps}) "
                              "or professor.order = 'd_then_g'")
        check("professor.d_hidden", self.d_hidden, between(1, 4096))
        check_finite("professor.d_lr", self.d_lr)
        check("professor.d_lr", self.d_lr, between(0.0, 10.0, low_open=True))
        check("professor.d_warmup", self.d_warmup, at_least(0))
        check_finite("professor.d_clip", self.d_clip)
        check("professor.d_clip", self.d_clip, at_least(0.0))
        check_finite("professor.d_weight_decay", self.d_weight_decay)
        check("professor.d_weight_decay", self.d_weight_decay, at_least(0.0))
        check("professor.fail_window", self.fail_window, at_least(-1))

    def describe(self) -> dict:
        """The manifest's record of the procedure (S1, Q5): every part the reference
        article says a complete Professor Forcing specification names."""
        d_steps = self.d_steps
        return {
            "over": self.over,
            "paths": {"teacher_forced": "prompt + reference response, train mode",
                      "free_running": "prompt + one sampled continuation (generation.*, "
                                      "sample 0 of (seed, window, example)); sampled in "
                                      "eval mode without gradients, then the generator's "
                                      "forward on it with gradients"},
            "behaviour": {"extractor": "final hidden state before the head, at each "
                                       "response step", "compare": self.compare,
                          "for_discriminator_step": "eval mode, no gradients, at the "
                                                    "window's generator parameters"},
            "discriminator": {"model": "linear projection, bidirectional GRU, MLP on both "
                                       "final states -> logit of P(teacher-forced)",
                              "hidden": self.d_hidden,
                              "loss": "sum_tf softplus(-z) + sum_free softplus(z), over N "
                                      "examples of the window",
                              "optimizer": self.d_optimizer, "lr": self.d_lr,
                              "schedule": self.d_schedule, "warmup": self.d_warmup,
                              "clock": "committed discriminator steps",
                              "clip": self.d_clip, "weight_decay": self.d_weight_decay,
                              "rng": "none drawn (no dropout); initial weights from "
                                     "(seed, 'discriminator')"},
            "generator": {"S": "sum_tf-tokens a_t (-log p) + lambda_free * sum_free "
                               "softplus(-z) + lambda_forced * sum_tf softplus(z)",
                          "D": "examples of the window (every micro-batch and rank)",
                          "nll": self.nll, "lambda_free": self.lambda_free,
                          "lambda_forced": self.lambda_forced,
                          "discriminator_in_generator_step": "frozen (no gradient)"},
            "order": {"name": self.order, "d_steps": d_steps,
                      "generator_sees": ("the discriminator after its d_steps steps"
                                         if self.order == "d_then_g" else
                                         "the discriminator at the window's start"),
                      "discriminator_sees": "the generator at the window's start"},
            "transaction": "one: both updates commit, or neither (a non-finite value "
                           "in either skips both); both clocks advance on commit only",
        }
