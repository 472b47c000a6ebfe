"""The declared sampling policy (Q1): configuration section ``generation``."""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.ranges import at_least, between, check, check_finite


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How the model's own tokens are drawn (Q1), for rollouts and ``exactstep generate``.

    ``temperature``: logits are divided by it before the softmax; ``0`` is greedy (the
    argmax, no draw). ``top_k``: only the ``k`` likeliest tokens (0 = all). ``top_p``:
    the smallest set of likeliest tokens whose probability reaches ``p`` (1 = all).
    ``max_new_tokens``: tokens drawn after the prompt, at most (a continuation ends
    earlier at its stop token). ``samples``: continuations per prompt (``K``), each
    with its own addressed stream ``(seed, window, example, sample)``. ``batch_rows``:
    rows (prompt, sample) sampled together in one batch with one key-value cache, at
    most (``sample_window``); it bounds the cache's memory, and batch composition
    changes a draw only where the logits' rounding moves it across a CDF boundary
    (docs/design/generation.md#batched-sampling). ``0``: each prompt's ``K`` rows
    alone (``sample_group``), whatever the window holds.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 16
    samples: int = 4
    batch_rows: int = 64

    def __post_init__(self) -> None:
        check_finite("generation.temperature", self.temperature)
        check("generation.temperature", self.temperature, at_least(0.0))
        check("generation.top_k", self.top_k, at_least(0))
        check("generation.top_p", self.top_p, between(0.0, 1.0, low_open=True))
        check("generation.max_new_tokens", self.max_new_tokens, between(1, 1 << 20))
        check("generation.samples", self.samples, between(1, 1 << 16))
        check("generation.batch_rows", self.batch_rows, between(0, 1 << 16))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def untruncated(self) -> bool:
        """Draws from the model's own distribution: temperature 1, no top-k or top-p."""
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0
