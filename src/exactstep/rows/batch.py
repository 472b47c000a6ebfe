"""The ``Batch``: the one type every objective compiler produces (R1-R3, R6, R8).

It carries row-aligned targets (the shift already applied), visibility described
structurally (segment ids, ``causal``, ``prefix_len``, ``source``, ``order``; never a
dense mask) and each row's ``Segment`` addresses; ``rows.invariants`` checks it.
Design and derivations: docs/design/rows.md#rowsbatchpy (R1-R3, R6, R8).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

import torch

from exactstep.rows import kernels

IGNORE_INDEX = -100
assert IGNORE_INDEX == kernels.IGNORE


class Segment(NamedTuple):
    """One contiguous run of one example inside a row (R6 row address).

    ``example_id``: the example's index in its source split. ``piece``: 0 for the
    first piece of the example, k for the k-th continuation after a split.
    ``offset``: index within the example's token sequence of this segment's first
    token. ``start``/``length``: the columns ``[start, start + length)`` of the row.
    An immutable named tuple: a batch holds one per piece, built on every batch.
    """

    example_id: int
    piece: int
    offset: int
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class SourceSide:
    """The encoder side of an encoder-decoder batch (R8): B rows of S tokens.

    ``segment_ids`` 0 on padding, 1, 2, ... per row in order; decoder segment ``s``
    of row ``b`` cross-attends exactly to encoder segment ``s`` of row ``b`` (the
    same example), and encoder attention is bidirectional within a segment.
    ``segments[b]`` are the encoder segments' addresses (R6), host data.
    """

    input_ids: torch.Tensor  # [B, S] int64
    position_ids: torch.Tensor  # [B, S] int64
    segment_ids: torch.Tensor  # [B, S] int32, 0 = padding
    segments: tuple[tuple[Segment, ...], ...]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def map(self, fn) -> SourceSide:
        """The same side with ``fn`` applied to every tensor (device moves, pinning)."""
        return replace(self, input_ids=fn(self.input_ids), position_ids=fn(self.position_ids),
                       segment_ids=fn(self.segment_ids))


@dataclass(frozen=True)
class Batch:
    """Row-aligned inputs and targets for B rows of T tokens.

    ``labels[b, i]`` is row ``(b, i)``'s target: the shift is already applied
    (``shift_owner == "collator"``), so no loss or model shifts again (R1). Key
    validity (``segment_ids > 0``), causality (``causal``), segment isolation (equal
    ``segment_ids``: 0 padding, then 1, 2, ... in row order) and loss ownership
    (``labels != IGNORE_INDEX``) stay separate; ownership never feeds attention (R2).
    ``segments[b]`` holds row ``b``'s addresses as host data (R6). Families add
    structure, never a dense mask: ``causal = False``, ``prefix_len``, ``source``,
    ``order`` (R8). Details: docs/design/rows.md#rowsbatchpy.
    """

    input_ids: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64, row-aligned targets, IGNORE_INDEX = no loss
    position_ids: torch.Tensor  # [B, T] int64
    segment_ids: torch.Tensor  # [B, T] int32, 0 = padding
    segments: tuple[tuple[Segment, ...], ...]  # per row, in column order
    causal: bool = True
    prefix_len: torch.Tensor | None = None  # [B, n_seg] bidirectional prefix (R8)
    weights: torch.Tensor | None = None  # [B, T] float per-row weights (L3 weighted)
    source: SourceSide | None = None  # encoder side (encoder-decoder families, R8)
    order: torch.Tensor | None = None  # [B, T] int64 factorisation rank (permutation LM)
    shift_owner: Literal["collator"] = "collator"
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    def num_targets(self) -> int:
        """Supervised rows. Host-side count: call before moving the batch to a device
        (host tensors are counted by a compiled sweep, the cheaper call for one batch)."""
        labels = self.labels
        if labels.is_cpu and labels.dtype is torch.int64:  # an integer tensor has no grad
            return kernels.count_supervised(labels.contiguous())
        return int((labels != IGNORE_INDEX).sum())

    def pin_memory(self) -> Batch:
        """The same batch in page-locked host memory (needs CUDA), so that a following
        ``to(cuda, non_blocking=True)`` does not make the host wait (U7)."""
        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or t.device.type != "cpu" else t.pin_memory()

        return self.map(pin)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return self.map(move)

    def map(self, fn) -> Batch:
        """The same batch with ``fn`` (``Tensor | None -> Tensor | None``) applied to
        every tensor, the encoder side's included; host data (``segments``) is kept."""
        return replace(
            self,
            input_ids=fn(self.input_ids),
            labels=fn(self.labels),
            position_ids=fn(self.position_ids),
            segment_ids=fn(self.segment_ids),
            prefix_len=fn(self.prefix_len),
            weights=fn(self.weights),
            order=fn(self.order),
            source=None if self.source is None else self.source.map(fn),
        )


def single_segment_batch(prompts: torch.Tensor, prefix_len: int | None = None) -> Batch:
    """A batch of ``G`` equal-length prompts, one segment each, positions ``0..L-1``;
    with ``prefix_len`` every row's first ``prefix_len`` columns are a bidirectional
    prefix (prefix LM, R8), the rest causal."""
    rows, length = prompts.shape  # [G, L]
    positions = torch.arange(length, dtype=torch.int64).expand(rows, length)
    segment = (Segment(example_id=0, piece=0, offset=0, start=0, length=length),)
    prefix = None if prefix_len is None else torch.full((rows, 1), prefix_len, dtype=torch.int64)
    return Batch(
        input_ids=prompts,
        labels=torch.full_like(prompts, IGNORE_INDEX),
        position_ids=positions.to(prompts.device),
        segment_ids=torch.ones(rows, length, dtype=torch.int32, device=prompts.device),
        segments=tuple(segment for _ in range(rows)),
        prefix_len=prefix,
    )


def source_rows(sources: Sequence[Sequence[int]], pad_id: int) -> SourceSide:
    """``G`` sources, one per row, left-aligned and padded with ``pad_id`` to the
    longest: one segment each (example 0, as ``rows.batch.single_segment_batch`` addresses
    the decoder rows), positions from 0, padding segment 0."""
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad_id, dtype=torch.int64)
    seg = torch.zeros((len(sources), width), dtype=torch.int32)
    for b, s in enumerate(sources):
        ids[b, :len(s)] = torch.as_tensor([int(t) for t in s], dtype=torch.int64)
        seg[b, :len(s)] = 1
    pos = torch.arange(width, dtype=torch.int64).expand(len(sources), width) * (seg > 0)
    segments = tuple((Segment(0, 0, 0, 0, len(s)),) for s in sources)
    return SourceSide(ids, pos, seg, segments)


def held_out_batches(batches: Iterable[Batch], max_tokens: int,
                     byte_lengths: Sequence[int] | None = None
                     ) -> Iterator[tuple[Batch, int, int]]:
    """The batches a held-out evaluation reads (L5, E1): those with targets, in order,
    until ``max_tokens`` targets were given; each with its target count and the bytes
    its targets spell (``byte_lengths``: one entry per id; 0 without it)."""
    lengths = torch.as_tensor(byte_lengths, dtype=torch.int64) if byte_lengths is not None \
        else None
    tokens = 0
    for batch in batches:
        if tokens >= max_tokens:
            return
        n = batch.num_targets()
        if n == 0:
            continue
        tokens += n
        spelled = (int(lengths[batch.labels[batch.labels != IGNORE_INDEX]].sum())
                   if lengths is not None else 0)
        yield batch, n, spelled
