"""Hand-built Batches for the model tests (no dependency on the rows compilers).

``packed_batch`` lays documents out left to right in each row, numbering segments
1, 2, ... and leaving the tail as padding (segment id 0), exactly as documented on
``Batch``. Labels are the next token of the same document; the last token of each
document has no target (R3 ``boundary = ignore``).
"""

from __future__ import annotations

import torch

from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment


def packed_batch(
    rows: list[list[list[int]]],
    seq_len: int,
    *,
    pad_id: int = 0,
    positions: str = "reset",
    causal: bool = True,
) -> Batch:
    """``rows[b]`` is the list of documents (token lists) packed into row b."""
    B = len(rows)
    input_ids = torch.full((B, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((B, seq_len), dtype=torch.long)
    segment_ids = torch.zeros((B, seq_len), dtype=torch.int32)
    segments = []
    example = 0
    for b, docs in enumerate(rows):
        col, row_segments = 0, []
        for k, doc in enumerate(docs):
            n = len(doc)
            assert col + n <= seq_len, "documents overflow the row"
            input_ids[b, col : col + n] = torch.tensor(doc)
            labels[b, col : col + n - 1] = torch.tensor(doc[1:], dtype=torch.long)
            start_pos = 0 if positions == "reset" else col
            position_ids[b, col : col + n] = torch.arange(start_pos, start_pos + n)
            segment_ids[b, col : col + n] = k + 1
            row_segments.append(Segment(example_id=example, piece=0, offset=0, start=col, length=n))
            example += 1
            col += n
        if positions == "continue" and col < seq_len:
            position_ids[b, col:] = torch.arange(col, seq_len)
        segments.append(tuple(row_segments))
    return Batch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        segments=tuple(segments),
        causal=causal,
    )


def random_documents(
    generator: torch.Generator, lengths: list[int], vocab_size: int
) -> list[list[int]]:
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def fill_rows(lengths: list[list[int]], vocab_size: int, seed: int = 0) -> list[list[list[int]]]:
    generator = torch.Generator().manual_seed(seed)
    return [random_documents(generator, row, vocab_size) for row in lengths]
