"""Settings of the masked-LM family (R8): the ``[mlm]`` section of a run.

Kept apart from the compiler (``compiler.py``) so that reading a configuration does
not import torch.
Design and derivations: docs/design/families.md#familiesmlmconfigpy (R8).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.errors import ConfigError
from exactstep.ranges import UNIT, between, check


@dataclass(frozen=True, kw_only=True)
class MLMConfig:
    """How the masked-LM compiler corrupts a piece (R8).

    ``mask_rate``: the fraction of a piece's eligible (non-special) tokens that is
    selected, in ``(0, 1]``; a piece with any eligible token has at least one
    selected. ``replace_mask`` / ``replace_random``: the probabilities that a selected
    position shows the mask token / a uniformly drawn non-special token; it keeps
    its own token with the rest, ``keep = 1 - replace_mask - replace_random``. The
    defaults are BERT's: 15% selected, 80/10/10. Only used when
    ``objective.family = "mlm"``. The rule in full: docs/design/families.md#familiesmlmcompilerpy.
    """

    mask_rate: float = 0.15
    replace_mask: float = 0.8
    replace_random: float = 0.1

    def __post_init__(self) -> None:
        check("mlm.mask_rate", self.mask_rate, between(0.0, 1.0, low_open=True))
        check("mlm.replace_mask", self.replace_mask, UNIT)
        check("mlm.replace_random", self.replace_random, UNIT)
        if self.replace_mask + self.replace_random > 1.0:
            raise ConfigError(
                f"mlm.replace_mask + mlm.replace_random must be <= 1 (the rest keeps its "
                f"token); got {self.replace_mask} + {self.replace_random}"
            )

    @property
    def keep(self) -> float:
        """The probability that a selected position keeps its own token."""
        return 1.0 - self.replace_mask - self.replace_random
