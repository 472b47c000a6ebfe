"""Human-readable rows (R6): inputs and targets side by side, with the masks.

``render_rows`` prints, for each column of each requested row, the segment, position,
input, target, ownership bit and visible span, so that the shift, the masks and chat
ownership (R5, H2) can be read off; it is what ``exactstep inspect`` prints unless a
family renders its rows itself.
Design and derivations: docs/design/rows.md#rowsinspectpy (R6, R2, R3, R5, H2).
"""

from __future__ import annotations

from typing import Protocol

from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment

NO_TARGET = "·"


class TokenizerLike(Protocol):
    def decode(self, ids: list[int]) -> str: ...


def token_label(tokenizer: TokenizerLike, token: int) -> str:
    """One token on one line, escaped (``\\n``, ``\\x..``), specials as ``<name>``."""
    shown = getattr(tokenizer, "token_text", None)
    if shown is not None:
        return shown(token)
    text = tokenizer.decode([token])
    return text.encode("unicode_escape").decode("ascii").replace(" ", "␣") or "''"


def visible_span(batch: Batch, b: int, seg_index: int, seg: Segment, col: int) -> tuple[int, int]:
    """Inclusive ``(first, last)`` columns row ``(b, col)`` attends to (R2, R3, R8)."""
    if not batch.causal:
        return seg.start, seg.stop - 1
    last = col
    if batch.prefix_len is not None:
        prefix = int(batch.prefix_len[b, seg_index])
        if col < seg.start + prefix:
            last = max(col, seg.start + prefix - 1)
    return seg.start, last


def render_rows(batch: Batch, tokenizer: TokenizerLike, rows: range) -> str:
    """A table per requested row (rows outside the batch are skipped): per column
    the segment, position, input, target (``·`` when the row owns no loss),
    ownership bit and visible span."""
    n_rows = batch.shape[0]
    chosen = [b for b in rows if 0 <= b < n_rows]
    if not chosen:
        return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{n_rows}"
    return "\n\n".join(render_row(batch, tokenizer, b) for b in chosen)


def render_row(batch: Batch, tokenizer: TokenizerLike, b: int) -> str:
    inputs = batch.input_ids[b].tolist()
    labels = batch.labels[b].tolist()
    positions = batch.position_ids[b].tolist()
    segment_ids = batch.segment_ids[b].tolist()
    segments = batch.segments[b]
    real = sum(seg.length for seg in segments)
    owned = sum(label != IGNORE_INDEX for label in labels)
    lines = [
        f"row {b}: {len(segments)} segment(s), {real} tokens, "
        f"{len(inputs) - real} padding, {owned} supervised rows (shift owner: {batch.shift_owner})"
    ]
    for s, seg in enumerate(segments, start=1):
        lines.append(
            f"  segment {s}: example {seg.example_id} piece {seg.piece} "
            f"tokens {seg.offset}..{seg.offset + seg.length - 1} at cols {seg.start}..{seg.stop - 1}"
        )
    shown_inputs = [token_label(tokenizer, token) for token in inputs]
    shown_targets = [NO_TARGET if label == IGNORE_INDEX else token_label(tokenizer, label)
                     for label in labels]
    w = max(8, *map(len, shown_inputs), *map(len, shown_targets))
    lines.append(f"  {'col':>4} {'seg':>3} {'pos':>4}  {'input':<{w}}   {'target':<{w}} own  visible")
    owner = {col: (k, seg) for k, seg in enumerate(segments) for col in range(seg.start, seg.stop)}
    for col, label in enumerate(labels):
        if col in owner:
            k, seg = owner[col]
            first, last = visible_span(batch, b, k, seg, col)
            visible = f"cols {first}..{last}"
        else:
            visible = "none (padding)"
        lines.append(
            f"  {col:>4} {segment_ids[col]:>3} {positions[col]:>4}  "
            f"{shown_inputs[col]:<{w}} → {shown_targets[col]:<{w}} "
            f"{int(label != IGNORE_INDEX):>3}  {visible}"
        )
    return "\n".join(lines)


def render_report(report: dict) -> str:
    """The data report (R4) as aligned ``key  value`` lines."""
    width = max(map(len, report), default=0)
    lines = ["data report"]
    for key, value in report.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"  {key:<{width}}  {shown}")
    return "\n".join(lines)


class PairLines(Protocol):
    def __call__(self, b: int, enc: Segment, dec: Segment) -> tuple[str, list[str]]: ...


def render_pair_rows(batch: Batch, tokenizer: TokenizerLike, rows: range, pair: PairLines,
                     note: str = "") -> str:
    """The requested rows of an encoder-decoder batch (rows outside it are skipped):
    per row a header, per segment pair its address and columns followed by
    ``pair(b, enc, dec)``'s ``(suffix of that line, lines)`` (what the family shows
    of the pair), then the decoder table. ``note`` ends the header's remark."""
    n_rows = batch.shape[0]
    chosen = [b for b in rows if 0 <= b < n_rows]
    if not chosen:
        return f"no rows in {rows.start}:{rows.stop}; the batch has rows 0:{n_rows}"
    return "\n\n".join(render_pair_row(batch, tokenizer, b, pair, note) for b in chosen)


def render_pair_row(batch: Batch, tokenizer: TokenizerLike, b: int, pair: PairLines,
                    note: str) -> str:
    source = batch.source
    assert source is not None
    dec_segments, enc_segments = batch.segments[b], source.segments[b]
    width = source.input_ids.shape[1]
    inputs, labels = batch.input_ids[b].tolist(), batch.labels[b].tolist()
    positions, segment_ids = batch.position_ids[b].tolist(), batch.segment_ids[b].tolist()
    enc_real, dec_real = sum(s.length for s in enc_segments), sum(s.length for s in dec_segments)
    lines = [
        f"row {b}: {len(dec_segments)} segment pair(s); encoder {enc_real}/{width} "
        f"columns, decoder {dec_real}/{len(inputs)} columns (shift owner: {batch.shift_owner}; "
        f"decoder segment s cross-attends to encoder segment s{note})"
    ]
    for s, (enc, dec) in enumerate(zip(enc_segments, dec_segments, strict=True), start=1):
        suffix, shown = pair(b, enc, dec)
        lines.append(f"  segment {s}: example {dec.example_id} piece {dec.piece} (from token "
                     f"{dec.offset}); encoder cols {enc.start}..{enc.stop - 1}, decoder cols "
                     f"{dec.start}..{dec.stop - 1}{suffix}")
        lines += shown
    shown_in = [token_label(tokenizer, t) for t in inputs]
    shown_out = [NO_TARGET if t == IGNORE_INDEX else token_label(tokenizer, t) for t in labels]
    w = max(8, *map(len, shown_in), *map(len, shown_out))
    lines.append(f"  {'col':>4} {'seg':>3} {'pos':>4}  {'decoder in':<{w}}   {'target':<{w}} own")
    for col, label in enumerate(labels):
        lines.append(f"  {col:>4} {segment_ids[col]:>3} {positions[col]:>4}  "
                     f"{shown_in[col]:<{w}} → {shown_out[col]:<{w}} "
                     f"{int(label != IGNORE_INDEX):>3}")
    return "\n".join(lines)


def text_of(tokenizer: TokenizerLike, tokens: list[int]) -> str:
    """The tokens as one string of their labels."""
    return "".join(token_label(tokenizer, t) for t in tokens)
