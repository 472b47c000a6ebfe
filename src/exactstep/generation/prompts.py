"""A window's prompts, shared by the window programs that sample (Q1): each example of a
micro-batch of prompts (``example_ids``) split into its prompt and reference response
(``split_example``), a ``Request`` per example, and responses laid out as rows of one
``Batch`` (``response_batch``, R1, R8). The policy family's rollouts and Professor
Forcing's free runs build on them; the sampler (``sampler``) draws the responses.
Design and derivations: docs/design/generation.md#generationpromptspy (Q1, R1, R8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from exactstep.errors import DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, source_rows
from exactstep.rows.example import Example


@dataclass(frozen=True)
class Request:
    """One example's rollout: the prompt, the reference response (its stop token
    included), and the reference tokens teacher-forced before sampling (MIXER)."""

    example_id: int
    prompt: tuple[int, ...]
    reference: tuple[int, ...]
    forced: tuple[int, ...]
    source: tuple[int, ...] | None = None  # the encoder side (encoder-decoder families)

    @property
    def context(self) -> tuple[int, ...]:
        return self.prompt + self.forced


def split_example(example: Example, over: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prompt, reference)``: for chats the last assistant turn (the example's last
    run of owned tokens) is the reference and every token before it the prompt; for
    text and for an encoder-decoder pair's target side the first token (BOS) is the
    prompt and the rest the reference."""
    tokens = [int(t) for t in example.tokens]
    if over in ("causal", "encdec") or example.owned is None:
        return tuple(tokens[:1]), tuple(tokens[1:])
    owned = np.asarray(example.owned, dtype=bool)
    if not owned.any():
        raise DataError(f"example {example.example_id} has no assistant turn to sample")
    end = int(np.flatnonzero(owned)[-1]) + 1
    start = end
    while start > 0 and owned[start - 1]:
        start -= 1
    return tuple(tokens[:start]), tuple(tokens[start:end])


def response_batch(rows: Sequence[tuple[Request, Sequence[int], int, bool]],
                   source_pad_id: int) -> Batch:
    """One row per ``(request, response, piece, supervised)``: the prompt and the
    response as inputs (the last token dropped), one segment addressed ``(example,
    piece)``, padded to the longest; the response's tokens its targets when
    ``supervised`` (R1: the column ``len(prompt) - 1`` predicts the first); with
    sources, each row's encoder side paired with it (R8). Families add their ``meta``."""
    seqs = [list(r.prompt) + list(resp) for r, resp, _, _ in rows]
    T = max([len(s) - 1 for s in seqs] or [1])
    B = len(rows)
    ids = torch.zeros((B, T), dtype=torch.int64)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.int64)
    positions = torch.zeros((B, T), dtype=torch.int64)
    segment_ids = torch.zeros((B, T), dtype=torch.int32)
    segments = []
    for b, ((r, resp, piece, supervised), seq) in enumerate(zip(rows, seqs, strict=True)):
        n = len(seq) - 1
        ids[b, :n] = torch.tensor(seq[:-1])
        positions[b, :n] = torch.arange(n)
        segment_ids[b, :n] = 1
        if supervised:
            first = len(r.prompt) - 1
            labels[b, first:first + len(resp)] = torch.tensor(list(resp))
        segments.append((Segment(example_id=r.example_id, piece=piece, offset=0, start=0,
                                 length=n),))
    side = None
    if rows and rows[0][0].source is not None:  # each row's encoder side, paired (R8)
        side = source_rows([r.source for r, _, _, _ in rows], source_pad_id)
        side = replace(side, segments=tuple(
            (Segment(example_id=r.example_id, piece=piece, offset=0, start=0,
                     length=len(r.source)),) for r, _, piece, _ in rows))
    return Batch(input_ids=ids, labels=labels, position_ids=positions,
                 segment_ids=segment_ids, segments=tuple(segments), source=side)


def example_ids(batch: Batch, microbatch: int) -> list[int]:
    """The examples of a micro-batch of prompts, in row order; every one whole (a piece
    of a split example cannot be a prompt). A padding micro-batch (``meta["padding"]``,
    added to a rank's share shorter than the window's, D1; its segments name example
    -1) holds none: the rank samples nothing for it and still joins the window."""
    if batch.meta.get("padding"):
        return []
    out = []
    for row in batch.segments:
        for seg in row:
            if seg.piece != 0 or seg.offset != 0:
                raise DataError(
                    f"policy: micro-batch {microbatch} holds example {seg.example_id} split "
                    f"across rows (piece {seg.piece}); every example must fit one row: raise "
                    "batch.seq_len or drop longer examples")
            out.append(seg.example_id)
    return out
