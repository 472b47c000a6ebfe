"""The causal-LM compiler: rows of pieces -> a ``Batch`` (R1, R2, R3, R5, R6).

Semantics of one segment holding tokens ``[a, a + L)`` of an example, at columns
``[c, c + L)`` of a row:

- input of column ``c + k`` is token ``a + k``;
- label of column ``c + k`` (``k < L - 1``) is token ``a + k + 1`` if that token is an
  owned target (``owned[a + k + 1]``), else ``IGNORE_INDEX``: the shift happens here,
  once, so row ownership is target ownership shifted by one (R1, R5);
- the segment's last column has no in-example target. With ``boundary = "ignore"`` its
  label is ``IGNORE_INDEX`` (R3); with ``"keep"`` it is the next segment's first token
  when another segment follows in the row (a deliberate continuous stream), else
  ``IGNORE_INDEX``;
- positions restart at 0 per segment (``positions = "reset"``) or equal the column
  (``"continue"``); segment ids are 1, 2, ... per row and 0 on padding;
- padding: input ``pad_id``, label ``IGNORE_INDEX``, position 0, segment 0;
- weights (``weighted=True``, L3): every column of the segment gets its example's
  ``weight``, so each supervised row carries the weight of the example that owns it,
  in every piece of a split example; padding gets 0. Under ``boundary = "keep"`` the
  kept boundary target carries the left segment's weight.

Loss ownership is only in ``labels``; visibility is only in ``segment_ids`` and
``causal`` (R2). Arrays are built in NumPy and handed to torch without copying.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from exactstep.errors import DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece


def compile_causal_batch(
    rows: Sequence[Sequence[Piece]],
    examples: Sequence[Example],
    *,
    seq_len: int,
    pad_id: int,
    boundary: str = "ignore",
    positions: str = "reset",
    weighted: bool = False,
) -> Batch:
    """One ``Batch`` of ``len(rows)`` rows x ``seq_len`` columns (see module doc).

    With ``weighted`` the batch carries ``weights`` [B, T] float32 from the examples'
    ``weight``; an example without one then raises ``DataError``.
    """
    n_rows = len(rows)
    input_ids = np.full((n_rows, seq_len), pad_id, dtype=np.int64)  # [B, T]
    labels = np.full((n_rows, seq_len), IGNORE_INDEX, dtype=np.int64)  # [B, T]
    position_ids = np.zeros((n_rows, seq_len), dtype=np.int64)  # [B, T]
    segment_ids = np.zeros((n_rows, seq_len), dtype=np.int32)  # [B, T]
    weights = np.zeros((n_rows, seq_len), dtype=np.float32) if weighted else None  # [B, T]
    columns = np.arange(seq_len, dtype=np.int64)  # [T]
    all_segments = []
    for r, row in enumerate(rows):
        segments = []
        start = 0
        for s, piece in enumerate(row, start=1):
            example = examples[piece.example]
            a, length, stop = piece.offset, piece.length, start + piece.length
            tokens = example.tokens
            input_ids[r, start:stop] = tokens[a : a + length]
            if length > 1:
                targets = tokens[a + 1 : a + length]
                if example.owned is not None:
                    targets = np.where(example.owned[a + 1 : a + length], targets, IGNORE_INDEX)
                labels[r, start : stop - 1] = targets
            position_ids[r, start:stop] = (
                columns[:length] if positions == "reset" else columns[start:stop]
            )
            segment_ids[r, start:stop] = s
            if weights is not None:
                weights[r, start:stop] = example_weight(example)
            segments.append(Segment(example.example_id, piece.piece, a, start, length))
            start = stop
        if boundary == "keep":
            for left, right in zip(segments, segments[1:], strict=False):
                labels[r, left.stop - 1] = input_ids[r, right.start]
        all_segments.append(tuple(segments))
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        position_ids=torch.from_numpy(position_ids),
        segment_ids=torch.from_numpy(segment_ids),
        segments=tuple(all_segments),
        weights=None if weights is None else torch.from_numpy(weights),
    )


def example_weight(example: Example) -> float:
    """The example's L3 weight; ``DataError`` when a weighted batch meets one without."""
    if example.weight is None:
        raise DataError(
            f"example {example.example_id} has no \"weight\" but the batch is weighted; "
            'give every example a "weight" (objective.reduction = weighted*)'
        )
    return example.weight
