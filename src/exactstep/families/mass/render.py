"""MASS rows for people (R6, R9): both sides of a row, the fragment put back.

For each requested row: its segment pairs, the masked encoder text, the decoder input
and the owned target (the fragment), and the piece rebuilt from both sides (the
fragment written back at its original positions), then the decoder table with each
column's position, so a reader sees the shift and the kept positions.
Design and derivations: docs/design/families.md#familiesmassrenderpy (R6, R9).
"""

from __future__ import annotations

from typing import Any

from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.inspect import render_pair_rows, text_of


def render_mass_rows(batch: Batch, tokenizer: Any, rows: range) -> str:
    """Tables of the requested rows (rows outside the batch are skipped)."""

    def pair(b: int, enc: Segment, dec: Segment) -> tuple[str, list[str]]:
        source = batch.source
        assert source is not None
        enc_tokens = source.input_ids[b, enc.start:enc.stop].tolist()
        owned = [t for t in batch.labels[b, dec.start:dec.stop].tolist() if t != IGNORE_INDEX]
        start = int(batch.position_ids[b, dec.start]) - int(source.position_ids[b, enc.start])
        return (f"; fragment {start}..{start + len(owned) - 1} of {enc.length - 1} content "
                "tokens", [
                    "    encoder: " + text_of(tokenizer, enc_tokens),
                    "    decoder: " + text_of(tokenizer,
                                              batch.input_ids[b, dec.start:dec.stop].tolist()),
                    "    target:  " + text_of(tokenizer, owned),
                    "    rebuilt: " + text_of(tokenizer, rebuild(enc_tokens, start, owned)),
                ])

    return render_pair_rows(batch, tokenizer, rows, pair,
                            "; decoder positions are the fragment's encoder positions")


def rebuild(encoder: list[int], start: int, targets: list[int]) -> list[int]:
    """The content tokens both sides describe: the encoder input (EOS dropped) with the
    fragment's targets written back from column ``start``."""
    out = list(encoder[:-1])
    out[start:start + len(targets)] = targets
    return out
