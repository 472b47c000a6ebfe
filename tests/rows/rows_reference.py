"""An independent, plain-Python statement of the causal row contract (R1-R3, R5, R6).

``expected_rows`` recomputes, from a batch's row addresses alone, what every column
must hold; ``assert_causal_rows`` compares a batch to it. Tests run the same check on
deliberately wrong compilers (below) to prove it can fail.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.example import Example


def owns(example: Example, j: int) -> bool:
    """``a_j``: is token ``j`` of the example a supervised target?"""
    if example.owned is None:
        return j >= 1
    return bool(example.owned[j])


def expected_rows(
    batch: Batch, examples_by_id: dict[int, Example], boundary: str, positions: str, pad_id: int
) -> dict[str, list[list[int]]]:
    n_rows, seq_len = batch.shape
    out = {
        "input_ids": [[pad_id] * seq_len for _ in range(n_rows)],
        "labels": [[IGNORE_INDEX] * seq_len for _ in range(n_rows)],
        "position_ids": [[0] * seq_len for _ in range(n_rows)],
        "segment_ids": [[0] * seq_len for _ in range(n_rows)],
    }
    for b, segments in enumerate(batch.segments):
        for s, seg in enumerate(segments, start=1):
            tokens = examples_by_id[seg.example_id].tokens.tolist()
            example = examples_by_id[seg.example_id]
            for k in range(seg.length):
                col, tok = seg.start + k, seg.offset + k
                out["input_ids"][b][col] = tokens[tok]
                out["segment_ids"][b][col] = s
                out["position_ids"][b][col] = k if positions == "reset" else col
                in_piece = k + 1 < seg.length
                if in_piece and owns(example, tok + 1):
                    out["labels"][b][col] = tokens[tok + 1]
            if boundary == "keep" and s < len(segments):
                nxt = segments[s]
                first = examples_by_id[nxt.example_id].tokens[nxt.offset]
                out["labels"][b][seg.stop - 1] = int(first)
    return out


def assert_causal_rows(
    batch: Batch, examples: list[Example], boundary: str, positions: str, pad_id: int
) -> None:
    """The batch holds exactly what the contract says for its own row addresses, and
    the row addresses tile each row from column 0 without gaps or overlaps."""
    by_id = {e.example_id: e for e in examples}
    for segments in batch.segments:
        col = 0
        for seg in segments:
            assert seg.start == col, "segments must tile the row from column 0"
            col = seg.stop
    want = expected_rows(batch, by_id, boundary, positions, pad_id)
    for name, rows in want.items():
        got = getattr(batch, name).tolist()
        assert got == rows, f"{name} differs from the contract"


# -- deliberately wrong compilers (negative controls) ----------------------------------


def compile_without_shift(rows, examples, **kw) -> Batch:
    """Labels equal inputs: the shift is missing (violates R1)."""
    batch = compile_causal_batch(rows, examples, **kw)
    labels = torch.where(batch.segment_ids > 0, batch.input_ids, IGNORE_INDEX)
    return replace(batch, labels=labels)


def compile_shifting_twice(rows, examples, **kw) -> Batch:
    """Labels two tokens ahead: the shift applied twice (violates R1)."""
    batch = compile_causal_batch(rows, examples, **kw)
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    labels[:, :-1] = batch.labels[:, 1:]
    return replace(batch, labels=labels)


def compile_keeping_boundary(rows, examples, **kw) -> Batch:
    """Supervises the cross-document target while claiming ``boundary = ignore`` (R3)."""
    return compile_causal_batch(rows, examples, **{**kw, "boundary": "keep"})


def compile_continuing_positions(rows, examples, **kw) -> Batch:
    """Positions run along the row while claiming ``positions = reset`` (R3)."""
    return compile_causal_batch(rows, examples, **{**kw, "positions": "continue"})


def compile_one_segment_per_row(rows, examples, **kw) -> Batch:
    """All documents of a row share one segment id: isolation lost (R2, R3)."""
    batch = compile_causal_batch(rows, examples, **kw)
    return replace(batch, segment_ids=(batch.segment_ids > 0).to(torch.int32))


def compile_ownership_unshifted(rows, examples, **kw) -> Batch:
    """Ownership applied to input rows (``l_i = a_i``) instead of ``a_(i+1)`` (R5)."""
    batch = compile_causal_batch(rows, examples, **kw)
    labels = batch.labels.clone()
    by_id = {e.example_id: e for e in examples}
    for b, segments in enumerate(batch.segments):
        for seg in segments:
            example = by_id[seg.example_id]
            for k in range(seg.length - 1):
                col, tok = seg.start + k, seg.offset + k
                labels[b, col] = (
                    int(example.tokens[tok + 1]) if owns(example, tok) else IGNORE_INDEX
                )
    return replace(batch, labels=labels)


WRONG_COMPILERS = {
    "no shift": compile_without_shift,
    "double shift": compile_shifting_twice,
    "cross-document target": compile_keeping_boundary,
    "positions not reset": compile_continuing_positions,
    "segments collapsed": compile_one_segment_per_row,
    "ownership unshifted": compile_ownership_unshifted,
}


def text_example(example_id: int, ids: list[int], owned: list[bool] | None = None) -> Example:
    return Example(
        example_id=example_id,
        tokens=np.array(ids, dtype=np.int64),
        owned=None if owned is None else np.array(owned, dtype=bool),
    )
