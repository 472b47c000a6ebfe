"""Span-corruption rows for people (R6, R8): both sides of a row, sentinels by name.

For each requested row: its segment pairs, the corrupted encoder text, the decoder
table, and the piece put back together from both sides, so that a reader sees that
nothing was lost or doubled.
Design and derivations: docs/design/families.md#familiesspanrenderpy (R6, R8).
"""

from __future__ import annotations

from typing import Any

from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.inspect import NO_TARGET, token_label


def render_span_rows(batch: Batch, tokenizer: Any, rows: range) -> str:
    """Tables of the requested rows (rows outside the batch are skipped)."""
    n_rows = batch.shape[0]
    chosen = [b for b in rows if 0 <= b < n_rows]
    if not chosen:
        return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{n_rows}"
    return "\n\n".join(render_span_row(batch, tokenizer, b) for b in chosen)


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


def render_span_row(batch: Batch, tokenizer: Any, b: int) -> str:
    source = batch.source
    assert source is not None
    sentinels = set(sentinel_names(tokenizer))
    dec_segments, enc_segments = batch.segments[b], source.segments[b]
    enc_ids = source.input_ids[b].tolist()
    inputs, labels = batch.input_ids[b].tolist(), batch.labels[b].tolist()
    positions, segment_ids = batch.position_ids[b].tolist(), batch.segment_ids[b].tolist()
    enc_real, dec_real = sum(s.length for s in enc_segments), sum(s.length for s in dec_segments)
    lines = [
        f"row {b}: {len(dec_segments)} segment pair(s); encoder {enc_real}/{len(enc_ids)} "
        f"columns, decoder {dec_real}/{len(inputs)} columns (shift owner: {batch.shift_owner}; "
        "decoder segment s cross-attends to encoder segment s)"
    ]
    for s, (enc, dec) in enumerate(zip(enc_segments, dec_segments, strict=True), start=1):
        enc_tokens = enc_ids[enc.start:enc.stop]
        targets = labels[dec.start:dec.stop]
        lines += [
            f"  segment {s}: example {dec.example_id} piece {dec.piece} (from token "
            f"{dec.offset}); encoder cols {enc.start}..{enc.stop - 1}, decoder cols "
            f"{dec.start}..{dec.stop - 1}",
            "    encoder: " + "".join(token_label(tokenizer, t) for t in enc_tokens),
            "    target:  " + "".join(token_label(tokenizer, t) for t in targets),
            "    rebuilt: " + "".join(token_label(tokenizer, t)
                                      for t in reconstruct(enc_tokens, targets, sentinels)),
        ]
    shown_in = [token_label(tokenizer, t) for t in inputs]
    shown_out = [NO_TARGET if t == IGNORE_INDEX else token_label(tokenizer, t) for t in labels]
    w = max(8, *map(len, shown_in), *map(len, shown_out))
    lines.append(f"  {'col':>4} {'seg':>3} {'pos':>4}  {'decoder in':<{w}}   {'target':<{w}} own")
    for col, label in enumerate(labels):
        lines.append(f"  {col:>4} {segment_ids[col]:>3} {positions[col]:>4}  "
                     f"{shown_in[col]:<{w}} → {shown_out[col]:<{w}} "
                     f"{int(label != IGNORE_INDEX):>3}")
    return "\n".join(lines)
