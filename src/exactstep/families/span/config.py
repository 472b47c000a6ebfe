"""T5 span corruption's settings and its length arithmetic, in pure Python (R8).

The ``[span]`` section (``SpanConfig``) and the deterministic part of T5's
definition, which depends only on a sequence's length: noise counts, corrupted
lengths and ``random_spans_helper``; ``compiler.py`` does the random part.
Design and derivations: docs/design/families.md#familiesspanconfigpy (R8).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.errors import ConfigError
from exactstep.ranges import at_least, between, check


@dataclass(frozen=True, kw_only=True)
class SpanConfig:
    """How T5 span corruption (``objective.family = "span"``) corrupts a text piece.

    ``noise_density``: the fraction of a piece's raw tokens that are noise, in
    ``(0, 1)`` (T5: 0.15). ``mean_noise_span_length``: the mean length of a noise
    span, >= 1 (T5: 3.0). ``sentinels``: how many sentinel tokens the byte tokenizer
    gets (``extra_id_0 .. extra_id_{n-1}``, T5's names; ``extra_id_0`` has the
    highest id, ids descending, as in T5); a run whose full row needs more noise
    spans than this is refused before it starts.
    """

    noise_density: float = 0.15
    mean_noise_span_length: float = 3.0
    sentinels: int = 100

    def __post_init__(self) -> None:
        check("span.noise_density", self.noise_density,
              between(0, 1, low_open=True, high_open=True))
        check("span.mean_noise_span_length", self.mean_noise_span_length, at_least(1))
        check("span.sentinels", self.sentinels, at_least(1))

    def noise_counts(self, r: int) -> tuple[int, int]:
        """``(N, K)``: noise tokens and noise spans of a raw sequence of ``r`` tokens:
        ``N = round(r * density)`` clamped to ``[1, r - 1]``, ``K = max(round(N /
        mean_span), 1)`` capped at ``r - N`` (Python's round); ``(0, 0)`` below two
        tokens."""
        if r < 2:
            return 0, 0
        noise = min(max(round(r * self.noise_density), 1), r - 1)
        spans = max(round(noise / self.mean_noise_span_length), 1)
        return noise, min(spans, r - noise)

    def corrupted_lengths(self, r: int) -> tuple[int, int]:
        """``(input length, target length)`` of a corrupted raw sequence of ``r``
        tokens, EOS included on both sides."""
        noise, spans = self.noise_counts(r)
        target_sentinels = spans if r >= 2 else min(r, 1)  # one non-noise span below 2
        return r - noise + spans + 1, noise + target_sentinels + 1

    def raw_length(self, inputs_length: int) -> tuple[int, int]:
        """``random_spans_helper(inputs_length, ...)`` with one sentinel per span on
        both sides: ``(tokens_length, targets_length)``."""
        return random_spans_helper(inputs_length, self.noise_density,
                                   self.mean_noise_span_length, 1, 1)


def random_spans_helper(inputs_length: int, noise_density: float, mean_noise_span_length: float,
                        extra_tokens_per_span_inputs: int,
                        extra_tokens_per_span_targets: int) -> tuple[int, int]:
    """T5's ``random_spans_helper``: ``(tokens_length, targets_length)`` such that a
    raw sequence of ``tokens_length`` tokens corrupts into exactly ``inputs_length``
    input tokens (EOS included), and its target's length (EOS included).

    The largest ``tokens_length`` whose input fits, found by T5's upward search from
    ``inputs_length - 1``; for ``noise_density == 0.5`` T5 then takes one token off
    both when the target would be longer than the input.
    """

    def lengths(tokens_length: int) -> tuple[int, int]:
        noise = int(round(tokens_length * noise_density))
        spans = int(round(noise / mean_noise_span_length))
        return (tokens_length - noise + spans * extra_tokens_per_span_inputs + 1,
                noise + spans * extra_tokens_per_span_targets + 1)

    tokens_length = inputs_length - 1
    while lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs, targets = lengths(tokens_length)
    if noise_density == 0.5 and targets > inputs:
        tokens_length -= 1
        targets -= 1
    return tokens_length, targets


def row_shape(cfg: SpanConfig, inputs_length: int) -> tuple[int, int, int]:
    """``(capacity, encoder columns, decoder columns)`` of a span row whose encoder
    side holds ``inputs_length`` columns: the helper's raw length and target length.

    Raises ``ConfigError`` when a full row of raw tokens would not fit its own
    widths (a row too short for span corruption) or would need more sentinels than
    ``span.sentinels``.
    """
    capacity, decoder = cfg.raw_length(inputs_length)
    enc, dec = cfg.corrupted_lengths(capacity)
    if capacity < 2 or enc > inputs_length or dec > decoder:
        raise ConfigError(
            f"batch.seq_len = {inputs_length} is too short for span corruption with "
            f"span.noise_density = {cfg.noise_density} and span.mean_noise_span_length = "
            f"{cfg.mean_noise_span_length}; raise batch.seq_len"
        )
    spans = cfg.noise_counts(capacity)[1]
    if spans > cfg.sentinels:
        raise ConfigError(
            f"a full row of {capacity} raw tokens has {spans} noise spans but span.sentinels "
            f"= {cfg.sentinels}; set span.sentinels >= {spans} or lower batch.seq_len"
        )
    return capacity, inputs_length, decoder
