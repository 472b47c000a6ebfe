"""The ``[permutation]`` section (R8): the permutation LM's partial-prediction cutoff.

Light (no torch at import); the compiler is ``compiler.py``.
Design and derivations: docs/design/families.md#familiespermutationconfigpy (R8).
"""

from __future__ import annotations

from dataclasses import dataclass

from exactstep.ranges import at_least, check


@dataclass(frozen=True, kw_only=True)
class PermutationConfig:
    """The ``[permutation]`` section (R8): the permutation LM's partial prediction.

    ``predict_one_in`` (K >= 1): the last ``ceil(F / K)`` free tokens of each
    segment's factorisation order are predicted (F: the segment's free tokens, i.e.
    its owned targets; capped at ``length - 1`` so the first token of the order is
    always context). 6 is XLNet's K; 1 predicts every free token.
    """

    predict_one_in: int = 6

    def __post_init__(self) -> None:
        check("permutation.predict_one_in", self.predict_one_in, at_least(1))
