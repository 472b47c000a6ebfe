"""Span-corruption rows for people (R6, R8): both sides of a row, sentinels by name.

For each requested row: its segment pairs, the corrupted encoder text, the decoder
table, and the piece put back together from both sides, so that a reader sees that
nothing was lost or doubled.
Design and derivations: docs/design/families.md#familiesspanrenderpy (R6, R8).
"""

from __future__ import annotations

from typing import Any

from exactstep.rows.batch import Batch, Segment
from exactstep.rows.inspect import render_pair_rows, text_of


def render_span_rows(batch: Batch, tokenizer: Any, rows: range) -> str:
    """Tables of the requested rows (rows outside the batch are skipped)."""
    sentinels = set(sentinel_names(tokenizer))

    def pair(b: int, enc: Segment, dec: Segment) -> tuple[str, list[str]]:
        assert batch.source is not None
        enc_tokens = batch.source.input_ids[b, enc.start:enc.stop].tolist()
        targets = batch.labels[b, dec.start:dec.stop].tolist()
        return "", ["    encoder: " + text_of(tokenizer, enc_tokens),
                    "    target:  " + text_of(tokenizer, targets),
                    "    rebuilt: " + text_of(tokenizer,
                                              reconstruct(enc_tokens, targets, sentinels))]

    return render_pair_rows(batch, tokenizer, rows, pair)


def sentinel_names(tokenizer: Any) -> dict[int, str]:
    """Sentinel id -> name, from the tokenizer's specials."""
    return {i: n for n, i in tokenizer.special_ids().items() if n.startswith("extra_id_")}


def reconstruct(inputs: list[int], targets: list[int], sentinels: set[int]) -> list[int]:
    """The raw tokens both sides describe: each input sentinel replaced by the target's
    tokens after the same sentinel, up to the next sentinel; EOS dropped on both."""
    spans: dict[int, list[int]] = {}
    current = None
    for token in targets[:-1]:
        if token in sentinels:
            current = spans.setdefault(token, [])
        elif current is not None:
            current.append(token)
    out: list[int] = []
    for token in inputs[:-1]:
        out.extend(spans.get(token, []) if token in sentinels else [token])
    return out
