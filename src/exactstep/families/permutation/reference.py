"""A pure-Python oracle for the permutation LM (R8): rows, labels and both streams' masks.

No torch, no NumPy: written from the definitions of ``compiler.py`` and
``model.permutation`` so that tests can compare the two. The random part (each
segment's order of its free tokens) is an input here: ``RefSegment.free_order``.
Design and derivations: docs/design/families.md#familiespermutationreferencepy (R8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IGNORE_INDEX = -100  # equal to exactstep.rows.batch.IGNORE_INDEX


@dataclass(frozen=True)
class RefSegment:
    """One segment: its ``tokens`` in natural order, which of them are ``context``
    (never predicted, first in the order, in natural order), and ``free_order``, the
    permutation of its free tokens (``free_order[t]`` = the index, among the free
    tokens in natural order, of the ``t``-th free token of the order)."""

    tokens: Sequence[int]
    context: Sequence[bool]
    free_order: Sequence[int]


def factorisation_order(segment: RefSegment) -> list[int]:
    """``z``: the segment's columns (0-based within it) in factorisation order."""
    context = [k for k, is_context in enumerate(segment.context) if is_context]
    free = [k for k, is_context in enumerate(segment.context) if not is_context]
    assert sorted(segment.free_order) == list(range(len(free))), "not a permutation"
    return context + [free[t] for t in segment.free_order]


def ranks(z: Sequence[int]) -> list[int]:
    """``rank[z[t]] = t``."""
    out = [0] * len(z)
    for t, col in enumerate(z):
        out[col] = t
    return out


def predicted(segment: RefSegment, predict_one_in: int) -> list[bool]:
    """Which columns are predicted: the last ``min(ceil(F / K), L - 1)`` of the order."""
    length = len(segment.tokens)
    free = sum(1 for c in segment.context if not c)
    n = min(-(-free // predict_one_in), length - 1) if length else 0
    n = max(n, 0)
    rank = ranks(factorisation_order(segment))
    return [rank[k] >= length - n for k in range(length)]


def compile_row(
    segments: Sequence[RefSegment], *, seq_len: int, pad_id: int, predict_one_in: int,
    positions: str = "reset",
) -> dict[str, list[int]]:
    """One row: ``input_ids``, ``labels``, ``position_ids``, ``segment_ids``, ``order``."""
    row = {"input_ids": [], "labels": [], "position_ids": [], "segment_ids": [], "order": []}
    for s, segment in enumerate(segments, start=1):
        start = len(row["input_ids"])
        rank = ranks(factorisation_order(segment))
        owned = predicted(segment, predict_one_in)
        for k, token in enumerate(segment.tokens):
            row["input_ids"].append(token)
            row["labels"].append(token if owned[k] else IGNORE_INDEX)
            row["position_ids"].append(k if positions == "reset" else start + k)
            row["segment_ids"].append(s)
            row["order"].append(rank[k])
    assert len(row["input_ids"]) <= seq_len, "the segments overflow the row"
    while len(row["input_ids"]) < seq_len:
        for key, value in (("input_ids", pad_id), ("labels", IGNORE_INDEX),
                           ("position_ids", 0), ("segment_ids", 0), ("order", 0)):
            row[key].append(value)
    return row


def stream_masks(
    segment_ids: Sequence[int], order: Sequence[int]
) -> tuple[list[list[bool]], list[list[bool]]]:
    """``(content, query)`` of one row, ``[i][j]``: may query ``i`` read key ``j``?

    Content: same real segment and ``order[j] <= order[i]``; a padding query reads
    only itself. Query stream: same real segment and ``order[j] < order[i]``.
    """
    n = len(segment_ids)
    content = [[False] * n for _ in range(n)]
    query = [[False] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            same = segment_ids[i] == segment_ids[j] != 0
            content[i][j] = (same and order[j] <= order[i]) or (i == j and segment_ids[i] == 0)
            query[i][j] = same and order[j] < order[i]
    return content, query


def query_depends_on(segment_ids: Sequence[int], order: Sequence[int], i: int) -> set[int]:
    """The columns whose tokens the query stream's output at ``i`` may depend on, through
    any number of layers: the content of every column of its segment ranked before it
    (the content stream at ``j`` depends on the tokens ranked at or before ``j``)."""
    return {j for j in range(len(segment_ids))
            if segment_ids[j] == segment_ids[i] != 0 and order[j] < order[i]}
