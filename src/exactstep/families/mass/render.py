"""MASS rows for people (R6, R9): both sides of a row, the fragment put back.

For each requested row: its segment pairs, the masked encoder text, the decoder input
and the owned target (the fragment), and the piece rebuilt from both sides (the
fragment written back at its original positions), then the decoder table with each
column's position, so a reader sees the shift and the kept positions.
Design and derivations: docs/design/families.md#familiesmassrenderpy (R6, R9).
"""

from __future__ import annotations

from typing import Any

from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.inspect import NO_TARGET, token_label


def render_mass_rows(batch: Batch, tokenizer: Any, rows: range) -> str:
    """Tables of the requested rows (rows outside the batch are skipped)."""
    n_rows = batch.shape[0]
    chosen = [b for b in rows if 0 <= b < n_rows]
    if not chosen:
        return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{n_rows}"
    return "\n\n".join(render_mass_row(batch, tokenizer, b) for b in chosen)


def rebuild(encoder: list[int], start: int, targets: list[int]) -> list[int]:
    """The content tokens both sides describe: the encoder input (EOS dropped) with the
    fragment's targets written back from column ``start``."""
    out = list(encoder[:-1])
    out[start:start + len(targets)] = targets
    return out


def render_mass_row(batch: Batch, tokenizer: Any, b: int) -> str:
    source = batch.source
    assert source is not None
    dec_segments, enc_segments = batch.segments[b], source.segments[b]
    enc_ids, enc_pos = source.input_ids[b].tolist(), source.position_ids[b].tolist()
    inputs, labels = batch.input_ids[b].tolist(), batch.labels[b].tolist()
    positions, segment_ids = batch.position_ids[b].tolist(), batch.segment_ids[b].tolist()
    enc_real, dec_real = sum(s.length for s in enc_segments), sum(s.length for s in dec_segments)
    lines = [
        f"row {b}: {len(dec_segments)} segment pair(s); encoder {enc_real}/{len(enc_ids)} "
        f"columns, decoder {dec_real}/{len(inputs)} columns (shift owner: {batch.shift_owner}; "
        "decoder segment s cross-attends to encoder segment s; decoder positions are the "
        "fragment's encoder positions)"
    ]

    def text(ids: list[int]) -> str:
        return "".join(token_label(tokenizer, t) for t in ids)

    for s, (enc, dec) in enumerate(zip(enc_segments, dec_segments, strict=True), start=1):
        enc_tokens = enc_ids[enc.start:enc.stop]
        owned = [t for t in labels[dec.start:dec.stop] if t != IGNORE_INDEX]
        start = positions[dec.start] - enc_pos[enc.start]
        lines += [
            f"  segment {s}: example {dec.example_id} piece {dec.piece} (from token "
            f"{dec.offset}); encoder cols {enc.start}..{enc.stop - 1}, decoder cols "
            f"{dec.start}..{dec.stop - 1}; fragment {start}..{start + len(owned) - 1} of "
            f"{enc.length - 1} content tokens",
            "    encoder: " + text(enc_tokens),
            "    decoder: " + text(inputs[dec.start:dec.stop]),
            "    target:  " + text(owned),
            "    rebuilt: " + text(rebuild(enc_tokens, start, owned)),
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
