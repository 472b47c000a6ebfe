"""A pure-Python oracle for the prefix LM family (R8), with no torch and no NumPy.

Written from the definitions, independently of ``compiler.py`` and of the attention
code: the rows, the visibility rule, what each row depends on after some layers,
and the supervised rows that would see their target (which must be none).
Design and derivations: docs/design/families.md#familiesprefixreferencepy (R8, R1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

IGNORE_INDEX = -100  # equal to exactstep.rows.batch.IGNORE_INDEX

Example = tuple[Sequence[int], Sequence[bool] | None]
Piece = tuple[int, int, int]  # (example id, offset, length)


def is_target(example: Example, j: int) -> bool:
    tokens, owned = example
    return j >= 1 if owned is None else bool(owned[j])


def prompt_length(example: Example) -> int:
    """Tokens before the first target (all of them when there is none)."""
    tokens = example[0]
    return next((j for j in range(len(tokens)) if is_target(example, j)), len(tokens))


def compile_rows(rows: Sequence[Sequence[Piece]], examples: Mapping[int, Example],
                 seq_len: int, pad_id: int) -> dict[str, list[list[int]]]:
    """The rows (``boundary = ignore``, ``positions = reset``) as plain lists, and
    ``prefix_len`` with one column per piece of the fullest row (at least one)."""
    width = max([len(row) for row in rows] + [1])
    out: dict[str, list[list[int]]] = {
        "input_ids": [], "labels": [], "position_ids": [], "segment_ids": [], "prefix_len": []}
    for row in rows:
        ids, labels = [pad_id] * seq_len, [IGNORE_INDEX] * seq_len
        positions, segments, prefix = [0] * seq_len, [0] * seq_len, [0] * width
        col = 0
        for s, (example_id, offset, length) in enumerate(row):
            example = examples[example_id]
            tokens = example[0]
            for k in range(length):
                ids[col + k] = tokens[offset + k]
                positions[col + k] = k
                segments[col + k] = s + 1
                nxt = offset + k + 1
                if k + 1 < length and is_target(example, nxt):
                    labels[col + k] = tokens[nxt]
            prefix[s] = max(0, min(prompt_length(example) - offset, length))
            col += length
        for name, value in (("input_ids", ids), ("labels", labels), ("position_ids", positions),
                            ("segment_ids", segments), ("prefix_len", prefix)):
            out[name].append(value)
    return out


def prefix_columns(segment_ids: Sequence[int], prefix_len: Sequence[int]) -> list[bool]:
    """Column ``j`` is inside its segment's prefix (segments are runs of one id)."""
    out, start = [], 0
    for j, s in enumerate(segment_ids):
        if j == 0 or s != segment_ids[j - 1]:
            start = j
        out.append(s != 0 and j - start < prefix_len[s - 1])
    return out


def visible(segment_ids: Sequence[int], prefix_len: Sequence[int] | None,
            causal: bool = True) -> list[list[bool]]:
    """``[T][T]``: query ``i`` may see key ``j``: same real segment, and ``j <= i`` or
    ``j`` in the segment's prefix (every query sees itself)."""
    T = len(segment_ids)
    keys = prefix_columns(segment_ids, prefix_len) if prefix_len is not None else [False] * T
    return [[i == j or (segment_ids[i] == segment_ids[j] != 0
                        and (not causal or j <= i or keys[j]))
             for j in range(T)] for i in range(T)]


def depends(view: Sequence[Sequence[bool]], layers: int) -> list[list[bool]]:
    """``[T][T]``: row ``i``'s output after ``layers`` layers can depend on token ``j``
    (a layer mixes the rows a query sees; the residual keeps its own)."""
    T = len(view)
    reach = [[i == j for j in range(T)] for i in range(T)]
    for _ in range(layers):
        reach = [[any(view[i][k] and reach[k][j] for k in range(T)) for j in range(T)]
                 for i in range(T)]
    return reach


def rows_seeing_their_target(labels: Sequence[int], segment_ids: Sequence[int],
                             view: Sequence[Sequence[bool]], layers: int) -> list[int]:
    """Supervised rows ``i`` that depend on some column ``j > i`` of their segment
    (the token they predict is column ``i + 1``)."""
    reach = depends(view, layers)
    T = len(labels)
    return [i for i in range(T) if labels[i] != IGNORE_INDEX
            and any(reach[i][j] and segment_ids[j] == segment_ids[i] for j in range(i + 1, T))]
