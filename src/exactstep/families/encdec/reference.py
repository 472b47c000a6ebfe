"""A plain-Python statement of the encoder-decoder row contract (R1, R2, R6, R8).

No NumPy, no torch: ``expected_pair_rows`` lays pairs out by hand, from the
Annotated Transformer's definition (decoder input ``tgt[:-1]``, scored ``tgt[1:]``,
``ntokens`` the non-pad targets, the source padded with its own pad id and seen by
no one), so that the compiler (``compiler.py``) can be compared with it exactly.
Design and derivations: docs/design/families.md#familiesencdecreferencepy (R1, R2, R6, R8).
"""

from __future__ import annotations

from collections.abc import Sequence

IGNORE = -100


def expected_pair_rows(
    rows: Sequence[Sequence[tuple[int, Sequence[int], Sequence[int]]]],
    *,
    seq_len: int,
    source_len: int,
    pad_id: int,
    source_pad_id: int,
    positions: str = "reset",
) -> dict[str, list]:
    """``rows[b]`` lists row b's pairs in column order as ``(example_id, source,
    target)``. Returns every tensor of the batch as nested lists, the segment
    addresses of both sides as ``(example_id, start, length)`` and ``ntokens``."""
    out: dict[str, list] = {name: [] for name in (
        "input_ids", "labels", "position_ids", "segment_ids", "source_ids",
        "source_position_ids", "source_segment_ids", "segments", "source_segments")}
    ntokens = 0
    for row in rows:
        dec = {"input_ids": [pad_id] * seq_len, "labels": [IGNORE] * seq_len,
               "position_ids": [0] * seq_len, "segment_ids": [0] * seq_len}
        enc = {"source_ids": [source_pad_id] * source_len, "source_position_ids": [0] * source_len,
               "source_segment_ids": [0] * source_len}
        col = scol = 0
        segments, source_segments = [], []
        for s, (example_id, source, target) in enumerate(row, start=1):
            decoder_input, scored = list(target[:-1]), list(target[1:])
            for k, (token, label) in enumerate(zip(decoder_input, scored, strict=True)):
                dec["input_ids"][col + k] = token
                dec["labels"][col + k] = label
                dec["position_ids"][col + k] = k if positions == "reset" else col + k
                dec["segment_ids"][col + k] = s
            for k, token in enumerate(source):
                enc["source_ids"][scol + k] = token
                enc["source_position_ids"][scol + k] = k if positions == "reset" else scol + k
                enc["source_segment_ids"][scol + k] = s
            segments.append((example_id, col, len(decoder_input)))
            source_segments.append((example_id, scol, len(source)))
            ntokens += sum(1 for label in scored if label != pad_id)
            col += len(decoder_input)
            scol += len(source)
        for name, values in {**dec, **enc}.items():
            out[name].append(values)
        out["segments"].append(segments)
        out["source_segments"].append(source_segments)
    out["ntokens"] = [ntokens]
    return out


def cross_visible(rows_segment_ids: Sequence[int], source_segment_ids: Sequence[int]
                  ) -> list[list[bool]]:
    """One row's cross-attention visibility ``[T][S]``: decoder column i sees source
    column j iff both carry the same non-zero segment id."""
    return [[q != 0 and q == k for k in source_segment_ids] for q in rows_segment_ids]
