"""Per-example weights read from the data (L3 ``weighted`` / ``weighted_count``).

A text or chat record may carry an optional numeric ``"weight"``; it belongs to the
whole example, so every supervised row of the example, in every packed piece, gets it
as its ``w_r`` (``rows.causal``). ``parse_weight`` is the one check of its value.
Design and derivations: docs/design/data.md#dataweightspy (L3).
"""

from __future__ import annotations

import math
from typing import Any

from exactstep.errors import DataError

WEIGHT_FIELD = "weight"


def parse_weight(record: dict[str, Any], where: str) -> float | None:
    """The record's ``"weight"`` as a finite float ``>= 0``, or ``None`` when absent.

    ``where`` names the line in errors (``file.jsonl:3``). An absent field is never a
    silent 1. Raises ``DataError`` for a string, a boolean, a negative, NaN or infinite
    number, or a number too large for a float.
    """
    if WEIGHT_FIELD not in record:
        return None
    value = record[WEIGHT_FIELD]
    weight = _as_float(value)
    if weight is None or not math.isfinite(weight) or weight < 0:
        raise DataError(
            f'{where}: "{WEIGHT_FIELD}" must be a finite number >= 0; got {value!r} '
            f'(fix the value or remove the "{WEIGHT_FIELD}" field)'
        )
    return weight


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return None
