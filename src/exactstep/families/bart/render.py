"""BART rows for people (R6, R9): per segment pair the noised source the encoder reads,
the decoder input and the owned target (the original piece), then the decoder table.

What ``exactstep inspect`` prints for ``objective.family = "bart"``; a reader sees the
noise on one side and the text it must give back on the other.
Design and derivations: docs/design/families.md#familiesbartrenderpy (R6, R9).
"""

from __future__ import annotations

from typing import Any

from exactstep.rows.batch import Batch, Segment
from exactstep.rows.inspect import render_pair_rows, text_of


def render_bart_rows(batch: Batch, tokenizer: Any, rows: range) -> str:
    """Tables of the requested rows (rows outside the batch are skipped)."""

    def pair(b: int, enc: Segment, dec: Segment) -> tuple[str, list[str]]:
        assert batch.source is not None
        return "", [
            "    source:     " + text_of(tokenizer,
                                         batch.source.input_ids[b, enc.start:enc.stop].tolist()),
            "    decoder in: " + text_of(tokenizer,
                                         batch.input_ids[b, dec.start:dec.stop].tolist()),
            "    target:     " + text_of(tokenizer, batch.labels[b, dec.start:dec.stop].tolist()),
        ]

    return render_pair_rows(batch, tokenizer, rows, pair)
