"""BART's settings and its row arithmetic, in pure Python (R9).

The ``[bart]`` section (``BartConfig``): the declared composition of noising
functions, in order, with each one's parameters, and the refusals that need no data
(unknown names, rates outside ``[0, 1]``, ``poisson_lambda <= 0``, a composition
that noises nothing). ``row_shape`` sizes a row; ``compiler.py`` does the draws.
Design and derivations: docs/design/families.md#familiesbartconfigpy (R9).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.errors import ConfigError
from exactstep.ranges import UNIT, above, check

#: Every noising function the family knows (R9), in no particular order.
NOISE_FUNCTIONS = ("token_masking", "token_deletion", "text_infilling",
                   "sentence_permutation", "document_rotation")
#: The functions that have a rate, and the ``[bart]`` key that holds it.
RATE_KEYS = {"token_masking": "token_masking_rate", "token_deletion": "token_deletion_rate",
             "text_infilling": "text_infilling_rate"}


@dataclass(frozen=True, kw_only=True)
class BartConfig:
    """How BART denoising (``objective.family = "bart"``) noises a text piece (R9).

    ``noise``: the composition, applied left to right to the piece's raw tokens, each
    name once (default BART-large's: ``sentence_permutation`` then ``text_infilling``).
    ``token_masking_rate``: each token is independently replaced by ``<mask>`` with this
    probability. ``token_deletion_rate``: each token is independently deleted with this
    probability. ``text_infilling_rate``: ``ceil(rate * n)`` of a piece's ``n`` tokens
    are covered by spans of Poisson(``poisson_lambda``) lengths, each span replaced by
    one ``<mask>`` (BART-large: 0.3, 3.0). Rates lie in ``[0, 1]``; a rate matters
    only when its function is listed. ``sentence_permutation`` and
    ``document_rotation`` have no parameter. ``ConfigError`` for an unknown or repeated
    name, and for a composition that leaves nothing to reconstruct (empty, or every
    listed function a rated one at rate 0).
    """

    noise: tuple[str, ...] = ("sentence_permutation", "text_infilling")
    token_masking_rate: float = 0.15
    token_deletion_rate: float = 0.15
    text_infilling_rate: float = 0.3
    poisson_lambda: float = 3.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise", tuple(self.noise))  # a list given in code
        for key in RATE_KEYS.values():
            check(f"bart.{key}", getattr(self, key), UNIT)
        check("bart.poisson_lambda", self.poisson_lambda, above(0))
        for name in self.noise:
            if name not in NOISE_FUNCTIONS:
                raise ConfigError(f"bart.noise names {name!r}, which is not a noising "
                                  f"function; choose from {', '.join(NOISE_FUNCTIONS)}")
            if self.noise.count(name) > 1:
                raise ConfigError(f"bart.noise lists {name!r} twice; list each noising "
                                  "function once, in the order it is applied")
        if all(name in RATE_KEYS and self.rate(name) == 0 for name in self.noise):
            listed = ", ".join(f"bart.{RATE_KEYS[n]} = 0" for n in self.noise) or "nothing"
            raise ConfigError(
                f"bart.noise = {list(self.noise)} leaves nothing to reconstruct ({listed}): "
                "the encoder would read the target itself; list a noising function with a "
                "positive rate")

    def rate(self, name: str) -> float | None:
        """The rate of noising function ``name``; ``None`` for one without a rate."""
        return getattr(self, RATE_KEYS[name]) if name in RATE_KEYS else None

    def composition(self) -> list[dict[str, object]]:
        """The manifest's passport of the composition (R9): each function, in order,
        with its parameters and laws."""
        laws = {
            "token_masking": lambda: {
                "rate": self.token_masking_rate,
                "law": "u = rng.random(n); token i -> <mask> where u[i] < rate"},
            "token_deletion": lambda: {
                "rate": self.token_deletion_rate,
                "law": "u = rng.random(n); token i deleted where u[i] < rate"},
            "text_infilling": lambda: {
                "rate": self.text_infilling_rate, "poisson_lambda": self.poisson_lambda,
                "law": "N = ceil(rate * n) (rate as written, exact) tokens covered by "
                       "non-overlapping spans; lengths rng.poisson(lambda, N) at a time until "
                       "they sum to >= N, the first to reach N cut to fit, later dropped; "
                       "zero-length spans beyond N - positive dropped (earliest kept); "
                       "slots = rng.permutation(n - N + k)[:k]; each span -> one <mask>, a "
                       "zero-length span inserts one <mask>"},
            "sentence_permutation": lambda: {
                "law": "order = rng.permutation(sentences); output sentence i = input "
                       "sentence order[i]",
                "splitter": "bytes: a sentence ends after '\\n' or after '.', '!', '?' "
                            "followed by ' '"},
            "document_rotation": lambda: {
                "law": "start = rng.integers(n) (no draw when n = 0); the piece rotated so "
                       "token start comes first"},
        }
        return [{"name": name, **laws[name]()} for name in self.noise]


def encoded_bound(raw: int) -> int:
    """The most encoder columns a piece of ``raw`` raw tokens can take, EOS included:
    masking, permutation and rotation keep the length, deletion shortens, and text
    infilling replaces ``N`` covered tokens by at most ``N`` masks, so ``raw + 1``."""
    return raw + 1


def row_shape(seq_len: int) -> tuple[int, int, int]:
    """``(capacity, encoder columns, decoder columns)`` of a BART row of ``seq_len``
    columns on each side: ``seq_len - 1`` planner tokens per row, so a full piece of
    raw tokens plus its EOS (encoder) or BOS (decoder) fills a side exactly.

    Raises ``ConfigError`` for a row that cannot hold two raw tokens (nothing to
    noise: no span, no second sentence, no rotation).
    """
    capacity = seq_len - 1
    if capacity < 2 or encoded_bound(capacity) > seq_len:
        raise ConfigError(f"batch.seq_len = {seq_len} is too short for BART denoising: a row "
                          "must hold at least two raw tokens and the EOS; raise batch.seq_len")
    return capacity, seq_len, seq_len
