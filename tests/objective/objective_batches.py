"""Small builders shared by the objective tests."""

from __future__ import annotations

import torch

from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment

X = IGNORE_INDEX


def make_batch(labels, segments=None, weights=None) -> Batch:
    """A batch with the given row-aligned ``labels`` (lists; ``X`` = ignored).

    ``segments[b]`` lists ``(example_id, piece, start, length)``; by default each row is
    one example (its row index) covering the whole row.
    """
    labels_BT = torch.tensor(labels, dtype=torch.int64)
    B, T = labels_BT.shape
    if segments is None:
        segments = [[(b, 0, 0, T)] for b in range(B)]
    seg_ids = torch.zeros(B, T, dtype=torch.int32)
    rows = []
    for b, row in enumerate(segments):
        row_segments = []
        for k, (example_id, piece, start, length) in enumerate(row):
            seg_ids[b, start : start + length] = k + 1
            row_segments.append(Segment(example_id, piece, 0, start, length))
        rows.append(tuple(row_segments))
    return Batch(
        input_ids=torch.zeros(B, T, dtype=torch.int64),
        labels=labels_BT,
        position_ids=torch.arange(T).expand(B, T).clone(),
        segment_ids=seg_ids,
        segments=tuple(rows),
        weights=None if weights is None else torch.tensor(weights, dtype=torch.float32),
    )
