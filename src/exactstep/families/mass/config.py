"""MASS settings and its length arithmetic, in pure Python (R9).

The ``[mass]`` section (``MassConfig``) and the deterministic part of the rule, which
depends only on a piece's length: the fragment length and the row shape;
``compiler.py`` does the random part (start, replacement).
Design and derivations: docs/design/families.md#familiesmassconfigpy (R9).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import UNIT, between, check

RATE_TOLERANCE = 1e-9  # how far mask_rate + random_rate + keep_rate may stray from 1


@dataclass(frozen=True, kw_only=True)
class MassConfig:
    """How MASS (``objective.family = "mass"``) masks a text piece (R9).

    ``fraction``: the fragment's share of a piece's ``r`` content tokens, in ``(0, 1]``
    (MASS: 0.5); the fragment has ``round(r * fraction)`` tokens (Python's round), at
    least 1 whenever ``r >= 1`` (``fragment_length``). ``start``: the law of the
    fragment's first token: ``"uniform"``, each of the ``r - k + 1`` starts equally
    likely (MASS's random start). ``mask_rate`` / ``random_rate`` / ``keep_rate``: the
    probabilities that a fragment token shows the ``<mask>`` token / a uniformly drawn
    non-special token / its own token in the encoder input (MASS, after BERT:
    0.8 / 0.1 / 0.1); each in ``[0, 1]``, summing to 1 within ``1e-9``.
    """

    fraction: float = 0.5
    start: Literal["uniform"] = "uniform"
    mask_rate: float = 0.8
    random_rate: float = 0.1
    keep_rate: float = 0.1

    def __post_init__(self) -> None:
        check("mass.fraction", self.fraction, between(0.0, 1.0, low_open=True))
        if self.start != "uniform":
            raise ConfigError(f"mass.start must be 'uniform'; got {self.start!r}")
        check("mass.mask_rate", self.mask_rate, UNIT)
        check("mass.random_rate", self.random_rate, UNIT)
        check("mass.keep_rate", self.keep_rate, UNIT)
        total = self.mask_rate + self.random_rate + self.keep_rate
        if abs(total - 1.0) > RATE_TOLERANCE:
            raise ConfigError(
                "mass.mask_rate + mass.random_rate + mass.keep_rate must sum to 1 (each "
                f"fragment token is masked, replaced or kept); got {self.mask_rate} + "
                f"{self.random_rate} + {self.keep_rate} = {total!r}"
            )

    def fragment_length(self, r: int) -> int:
        """``k``: fragment tokens of a piece of ``r`` content tokens: 0 when ``r == 0``,
        else ``round(r * fraction)`` clamped to ``[1, r]``."""
        if r < 1:
            return 0
        return min(max(round(r * self.fraction), 1), r)

    def decoder_length(self, r: int) -> int:
        """Decoder columns of such a piece: ``k``, or one unsupervised column when
        ``k == 0`` (a piece of no content still has its segment pair)."""
        return max(self.fragment_length(r), 1)


def row_shape(cfg: MassConfig, seq_len: int) -> tuple[int, int, int]:
    """``(capacity, encoder columns, decoder columns)`` of a MASS row whose encoder side
    holds ``seq_len`` columns: ``seq_len - 1`` content tokens (the encoder's EOS takes
    one column) and the fragment of a full row.

    Raises ``ConfigError`` when the row cannot hold a fragment (``seq_len < 2``).
    """
    capacity = seq_len - 1
    if capacity < 1:
        raise ConfigError(
            f"batch.seq_len = {seq_len} cannot hold a MASS fragment: a row holds "
            "batch.seq_len - 1 content tokens and the encoder's EOS; raise batch.seq_len "
            "to at least 2"
        )
    return capacity, seq_len, cfg.decoder_length(capacity)
