"""Attention that realises a Batch's visibility on each device (R2, R3, R8).

A query sees keys of its own real segment (earlier ones, or its segment's prefix,
when the batch is causal); padding sees only itself and labels never enter (R2).
``prepare_visibility`` builds this once per forward as a dense mask, per-document
SDPA buckets or a FlexAttention block mask (``resolve_impl`` picks per device; on
the CPU ``auto`` weighs dense against per-document by the batch's layout and the
thread count, S9), and ``attend`` applies it in every layer without a hidden host
sync (U7).
Design and derivations: docs/design/model.md#modelattentionpy,
docs/design/model.md#auto-on-cpu (R2, R3, R8, U7).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from math import inf

import numpy as np
import torch
import torch.nn.functional as F

from exactstep.errors import ModelError
from exactstep.rows.batch import Batch
from exactstep.rows.transfer import host_to_device

IMPLEMENTATIONS = ("auto", "segments", "dense", "flex")

# Compiled FlexAttention (Triton's tl.dot) needs every head dimension >= 16 on CUDA.
FLEX_MIN_HEAD_DIM = 16
# FlexAttention's default tile: the block mask describes (128 x 128) query/key blocks.
FLEX_BLOCK_SIZE = 128

# Cost model of the CPU attention paths, in units of one key-query pair (forward and
# backward). Per-document SDPA ("segments"): a bucket of length L holding n segments
# costs n * L * (L + _LINEAR_COST) (the attention is quadratic, gathers and softmax
# rows are linear) plus a fixed cost per bucket (about ten small operators forward
# and backward) plus a cost per document (the kernel's work per sequence and head).
# The dense mask costs B * T * (T + _LINEAR_COST). The fixed costs depend on the
# intra-op thread count: an operator on several threads waits for all of them, and
# the per-sequence work does not shrink with them as the pair work does. "auto" on
# CPU runs whichever is cheaper at the run's thread count (``auto_costs``), with
# buckets sized at that count. Measured on 2 shared CPU cores (one unit ~0.03 us on
# one thread at d_model 128): docs/design/model.md#auto-on-cpu.
_LINEAR_COST = 32
_CALL_COST = 30000  # per bucket, one thread (and the explicit "segments" buckets)
_CALL_COST_THREADED = 300_000  # per bucket, two threads (used for every count above one)
_DOCUMENT_COST = 500  # per document, one thread
_DOCUMENT_COST_THREADED = 1500  # per document, two threads (and above)
# "auto" never builds a dense mask of more than 2**26 key-query pairs (64 MiB as
# bool, SDPA's float copy 256 MiB): beyond that memory, not time, decides.
_DENSE_MAX_PAIRS = 2**26


@dataclass(frozen=True)
class _Bucket:
    """``count`` segments stacked at one padded length ``length``."""

    length: int
    count: int
    key_mask: torch.Tensor | None  # [count, 1, 1, length] bool, only when not causal
    prefix_mask: torch.Tensor | None = None  # [count, 1, length, length] bool, prefix LM

    @property
    def mask(self) -> torch.Tensor | None:
        """The explicit SDPA mask of this bucket, or ``None`` (then ``is_causal`` decides)."""
        return self.key_mask if self.key_mask is not None else self.prefix_mask


@dataclass(frozen=True)
class Visibility:
    """Everything attention needs for one forward, built once and shared by all layers.

    Build it with ``prepare_visibility``; its fields are private to this module.

    For ``"segments"`` the B*T positions are laid out in *slots*: the buckets' stacked
    segments one after another (each right-padded to its bucket length), then the
    padding positions. ``slot_of[p]`` is position p's slot; ``position_of[s]`` is the
    position slot s reads (bucket padding reads its segment's first position);
    ``position_or_none[s]`` is the same with bucket padding mapped to ``B*T`` (none).
    """

    impl: str  # "segments" | "dense" | "flex"
    batch_shape: tuple[int, int]  # (B, T)
    causal: bool  # batch.causal; with a prefix the buckets carry explicit masks
    dense_mask: torch.Tensor | None = None  # [B, 1, T, T] bool (dense)
    buckets: tuple[_Bucket, ...] = ()  # segments
    slot_sizes: tuple[int, ...] = ()  # segments: count * length per bucket, then padding
    slot_of: torch.Tensor | None = None  # [B*T] long
    position_of: torch.Tensor | None = None  # [S] long
    position_or_none: torch.Tensor | None = None  # [S] long, B*T = none
    whole_rows: bool = False  # segments: every row is one document filling it
    block_mask: object | None = None  # flex BlockMask


def resolve_impl(
    impl: str, device: torch.device, head_dim: int | None = None, *,
    batch: Batch | None = None, threads: int | None = None,
) -> str:
    """The implementation ``impl`` runs as on ``device``; validates the name.

    ``"auto"`` is ``"flex"`` on CUDA unless ``head_dim`` (when given) is below
    ``FLEX_MIN_HEAD_DIM``, where compiled FlexAttention cannot run. On the CPU, given
    the ``batch``, it is the cheaper of ``"segments"`` and ``"dense"`` under the cost
    model at ``threads`` intra-op threads (default: ``torch.get_num_threads()``) for
    causal rows of several documents without a prefix (``auto_costs``); everywhere
    else it is ``"segments"``. The choice is a pure function of the batch's segment
    layout, the thread count and the device (host data, no sync; S9 restores the
    thread count on resume, so a resumed run chooses the same). An explicit
    ``"flex"`` below that head dimension on CUDA is refused with a ``ModelError``.
    """
    if impl not in IMPLEMENTATIONS:
        raise ModelError(
            f"model.attention must be one of {', '.join(IMPLEMENTATIONS)}; got {impl!r}"
        )
    device = torch.device(device)
    small_head = head_dim is not None and head_dim < FLEX_MIN_HEAD_DIM
    if impl == "auto":
        if device.type == "cuda" and not small_head:
            return "flex"
        if batch is not None and device.type == "cpu" and _auto_weighs(batch):
            costs = auto_costs(batch, torch.get_num_threads() if threads is None else threads)
            return "dense" if costs["dense"] < costs["segments"] else "segments"
        return "segments"
    if impl == "flex" and device.type == "cuda" and small_head:
        raise ModelError(
            f"model.attention = 'flex' needs a head dimension (model.d_model / model.n_heads) "
            f"of at least {FLEX_MIN_HEAD_DIM} on CUDA; got {head_dim}. Use model.attention = "
            "'auto' or 'segments', or fewer, wider heads"
        )
    return impl


def _auto_weighs(batch: Batch) -> bool:
    """``"auto"`` weighs the two CPU paths for this batch: causal, no prefix (the
    layouts the cost model is calibrated on), and not whole rows (which run as one
    plain causal SDPA, faster than either)."""
    return batch.causal and batch.prefix_len is None and not _whole_rows(batch)


def prepare_visibility(
    batch: Batch, impl: str, device: torch.device, *, head_dim: int | None = None,
    threads: int | None = None,
) -> Visibility:
    """Build the visibility of ``batch`` for ``impl`` on ``device`` (once per forward).

    The rule every ``impl`` realises (R2, R3, R8): query ``i`` sees key ``j`` iff both
    lie in one real segment and, when ``batch.causal``, ``j <= i`` or ``j`` is in that
    segment's prefix (``prefix_keys``). A padding query sees only itself, so its
    output is its own value vector (finite, never read by a real row). ``labels``
    are never read. Every path but ``"dense"`` equals ``"dense"`` to 1e-5 in fp32.

    ``head_dim`` (the model's ``d_model / n_heads``) lets ``"auto"`` avoid FlexAttention
    where it cannot run; ``threads`` (default: the intra-op thread count in force) is
    what ``"auto"`` weighs the CPU paths at, and sizes its buckets (``resolve_impl``).
    Whole rows without a prefix take the plain causal SDPA path under every
    implementation but ``"dense"`` (the reference); with one, the per-document path.

    Failure modes: unknown ``impl``; ``"flex"`` on CPU with gradients enabled (no
    FlexAttention backward there) or on CUDA below the minimum head dimension; a
    ``prefix_len`` on a bidirectional batch, or (checked when it is on the CPU) of
    the wrong shape or outside ``[0, segment length]``; for every path but
    ``"dense"``, ``batch.segments`` disagreeing with ``segment_ids`` (checked only
    when ``segment_ids`` is on the CPU, where the check costs no sync).
    """
    device = torch.device(device)
    threads = torch.get_num_threads() if threads is None else threads
    chosen = resolve_impl(impl, device, head_dim, batch=batch, threads=threads)
    if batch.prefix_len is not None:
        check_prefix_len(batch)
    if chosen == "flex" and device.type != "cuda" and torch.is_grad_enabled():
        raise ModelError(
            "model.attention = 'flex' cannot train on CPU (FlexAttention has no CPU "
            "backward); set model.attention to 'auto' or 'segments'"
        )
    if chosen == "dense":
        return _prepare_dense(batch, device)
    if batch.segment_ids.device.type == "cpu":
        _check_segments_match_ids(batch)  # the other paths read batch.segments (R3)
    if batch.prefix_len is None and _whole_rows(batch):
        # every row is one document filling it: exactly causal (or full) visibility
        return Visibility(impl="segments", batch_shape=batch.shape, causal=batch.causal,
                          whole_rows=True)
    if chosen == "flex" and not _whole_rows(batch):
        return _prepare_flex(batch, device)
    # "auto" sizes its buckets at the thread count it weighed; "segments" is fixed
    call_cost = bucket_call_cost(threads) if impl == "auto" else _CALL_COST
    return _prepare_segments(batch, device, call_cost)  # whole rows with a prefix: one SDPA


def check_prefix_len(batch: Batch) -> None:
    """Refuse a ``prefix_len`` the visibility rule cannot read (R8).

    Always: on a bidirectional batch. When ``prefix_len`` is on the CPU (no sync):
    a shape other than ``[B, n_seg]`` with ``n_seg`` at least the most segments of
    any row, a non-integer dtype, or a value outside ``[0, length]`` of its segment.
    Raises ``ModelError`` naming the row and segment.
    """
    prefix = batch.prefix_len
    if not batch.causal:
        raise ModelError(
            "batch.prefix_len declares a bidirectional prefix on a batch that is already "
            "bidirectional (causal = False); drop prefix_len or make the batch causal"
        )
    if prefix.device.type != "cpu":
        return
    B = batch.shape[0]
    most = max((len(row) for row in batch.segments), default=0)
    if (prefix.dim() != 2 or prefix.shape[0] != B or prefix.shape[1] < max(most, 1)
            or prefix.dtype.is_floating_point or prefix.dtype == torch.bool):
        raise ModelError(
            f"batch.prefix_len must be an integer [B, n_seg] tensor with B = {B} and n_seg "
            f">= {max(most, 1)} (one entry per segment); got {prefix.dtype} "
            f"{tuple(prefix.shape)}"
        )
    values = prefix.tolist()
    for b, row in enumerate(batch.segments):
        for k, seg in enumerate(row):
            if not 0 <= values[b][k] <= seg.length:
                raise ModelError(
                    f"batch row {b} segment {k + 1}: prefix_len {values[b][k]} is outside "
                    f"[0, {seg.length}] (the segment's length); rebuild the batch with the "
                    "prefix compiler"
                )


def prefix_keys(segment_ids: torch.Tensor, prefix_len: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: column ``j`` lies inside its segment's bidirectional prefix.

    Column ``j`` of segment ``k`` (id ``k + 1``) starting at column ``s`` is a prefix
    key iff ``j - s < prefix_len[b, k]``; padding never is. Computed on the device of
    ``segment_ids`` from the ids alone (segments are contiguous runs of one id), so
    no host read is needed.
    """
    B, T = segment_ids.shape
    device = segment_ids.device
    columns = torch.arange(T, device=device).expand(B, T)  # [B, T]
    starts = torch.ones(B, T, dtype=torch.bool, device=device)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]  # a run begins here
    first = torch.where(starts, columns, 0).cummax(dim=1).values  # [B, T] its first column
    which = (segment_ids.long() - 1).clamp(min=0)  # [B, T] segment index (padding -> 0)
    length = prefix_len.to(device=device, dtype=torch.int64).gather(1, which)  # [B, T]
    return (segment_ids != 0) & (columns - first < length)


def _whole_rows(batch: Batch) -> bool:
    """Every row holds one segment covering all ``T`` columns (host data, no sync)."""
    T = batch.shape[1]
    return all(len(row) == 1 and row[0].start == 0 and row[0].length == T
               for row in batch.segments)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """Scaled dot-product attention under ``vis``: ``[B, nH, T, Dh]`` x3 -> ``[B, nH, T, Dh]``."""
    _check_shape(q.shape[0], q.shape[2], vis)
    if vis.impl == "segments" and not vis.whole_rows:
        qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2)  # [B, T, 3, nH, Dh]
        return _attend_segments(qkv, vis).transpose(1, 2)
    return _attend_rows(q, k, v, vis)


def attend_fused(qkv: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """The same attention on the projection's layout; the decoder's hot path.

    ``qkv [B, T, 3, nH, Dh]`` (rotated queries and keys, values) -> ``[B, T, nH, Dh]``.
    The per-document path moves q, k and v together in one gather per layer (and
    one in backward) instead of three; whole-row paths use views.
    """
    _check_shape(qkv.shape[0], qkv.shape[1], vis)
    if vis.impl == "segments" and not vis.whole_rows:
        return _attend_segments(qkv, vis)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))  # [B, nH, T, Dh] each
    return _attend_rows(q, k, v, vis).transpose(1, 2)


def _check_shape(B: int, T: int, vis: Visibility) -> None:
    if (B, T) != vis.batch_shape:
        raise ModelError(
            f"attention input has batch shape {(B, T)} but the visibility was prepared "
            f"for {vis.batch_shape}; prepare it from the same batch"
        )


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility):
    """Whole-row implementations: ``[B, nH, T, Dh]`` x3 -> ``[B, nH, T, Dh]``."""
    if vis.impl == "dense":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=vis.dense_mask)
    if vis.impl == "flex":
        return _flex_attention()(q, k, v, block_mask=vis.block_mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=vis.causal)  # whole rows


# ----------------------------------------------------------------------------- dense


def dense_visibility_mask(
    segment_ids: torch.Tensor, causal: bool, prefix_len: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference mask ``[B, 1, T, T]``: True where query i may see key j (R2, R3, R8).

    Same real segment, and when ``causal`` either ``j <= i`` or ``j`` a key of its
    segment's prefix (``prefix_keys``, when ``prefix_len`` is given); every query
    sees itself.
    """
    seg_q = segment_ids[:, :, None]  # [B, T, 1]
    seg_k = segment_ids[:, None, :]  # [B, 1, T]
    T = segment_ids.shape[1]
    allowed = (seg_q == seg_k) & (seg_q != 0)  # [B, T, T] same real segment
    if causal:
        order = torch.ones(T, T, dtype=torch.bool, device=segment_ids.device).tril()
        if prefix_len is not None:
            order = order | prefix_keys(segment_ids, prefix_len)[:, None, :]  # [B, T, T]
        allowed &= order
    allowed |= torch.eye(T, dtype=torch.bool, device=segment_ids.device)  # padding: self
    return allowed[:, None]  # [B, 1, T, T]


def windowed_visibility(
    visible: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    sliding: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``visible`` ``[B, 1, T, T]`` narrowed to an attention window (R3), read on the
    rows' own positions: ``sliding`` keeps keys fewer than ``sliding`` positions back
    (``pos_i - pos_j < sliding``), ``chunk`` keeps the keys of the query's chunk
    (``pos_i // chunk == pos_j // chunk``). With positions that restart at 0 in each
    document, a packed document sees exactly what it sees alone; every query still
    sees itself.
    """
    pos_q = position_ids[:, None, :, None]  # [B, 1, T, 1]
    pos_k = position_ids[:, None, None, :]  # [B, 1, 1, T]
    if sliding is not None:
        visible = visible & (pos_q - pos_k < sliding)
    if chunk is not None:
        visible = visible & (pos_q.div(chunk, rounding_mode="floor")
                             == pos_k.div(chunk, rounding_mode="floor"))
    return visible


def _prepare_dense(batch: Batch, device: torch.device) -> Visibility:
    seg = host_to_device(batch.segment_ids, device)
    prefix = None if batch.prefix_len is None else host_to_device(batch.prefix_len, device)
    return Visibility(
        impl="dense",
        batch_shape=tuple(seg.shape),
        causal=batch.causal,
        dense_mask=dense_visibility_mask(seg, batch.causal, prefix),
    )


# ------------------------------------------------------------------------------ flex


@functools.cache
def _flex_attention():  # pragma: no cover - exercised on CUDA only
    from torch.nn.attention.flex_attention import flex_attention

    if torch.cuda.is_available():
        # automatic dynamic shapes: the first shape compiles static kernels; a shape
        # that changes once (an evaluation batch of fewer rows, another length) is
        # recompiled once with that dimension symbolic instead of once per value
        return torch.compile(flex_attention, dynamic=None)
    return flex_attention


def segment_block_mask(
    segments: tuple[tuple, ...], T: int, causal: bool, block: int = FLEX_BLOCK_SIZE,
    *, prefix: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Which ``block x block`` tiles of each row's ``[T, T]`` visibility are needed.

    Returns ``(partial, full)``, int32 ``[B, 1, nq, nk]`` with ``nq = nk = ceil(T /
    block)``: ``full`` where every pair of the tile is visible (the kernel skips the
    ``mask_mod`` there), ``partial`` where some but not all pairs are (the ``mask_mod``
    decides each pair). Computed from the segments' column ranges (host data) in
    ``O(tiles)``; no ``[T, T]`` mask exists. Tiles reaching past ``T`` are never full
    (the columns past ``T`` count as invisible), as ``create_block_mask`` has it.

    Visibility (``prepare_visibility``'s rule): ``i`` sees ``j`` iff both are in one
    segment (and ``j <= i`` when causal), or ``i == j``. With ``prefix`` (a causal
    batch whose segments may have bidirectional prefixes of lengths the host does not
    know) any tile of a segment's square may hold a visible pair, so all are needed;
    full ones are still only the wholly causal ones, which every prefix leaves fully
    visible.
    """
    B, n = len(segments), -(-T // block)
    start = np.arange(n) * block  # [n] first column of each tile
    stop = start + block  # [n] one past its last column (may pass T)
    partial = np.zeros((B, 1, n, n), dtype=bool)
    full = np.zeros((B, 1, n, n), dtype=bool)
    diagonal = np.arange(n)
    partial[:, 0, diagonal, diagonal] = True  # i == j: every query sees itself
    for b, row in enumerate(segments):
        for seg in row:
            if not seg.length:
                continue
            s0, s1 = seg.start, seg.start + seg.length
            tiles = np.arange(s0 // block, (s1 - 1) // block + 1)  # tiles touching it
            q0, q1 = start[tiles], stop[tiles]
            if causal and not prefix:  # some j <= i: the segment's first key <= its last query
                seen = np.maximum(s0, q0)[None, :] <= np.minimum(s1, q1)[:, None] - 1
            else:
                seen = np.ones((tiles.size, tiles.size), dtype=bool)
            inside = (q0 >= s0) & (q1 <= s1)  # the whole tile lies in the segment
            whole = inside[:, None] & inside[None, :]
            if causal:  # every key <= every query
                whole &= (q1 - 1)[None, :] <= q0[:, None]
            grid = np.ix_(tiles, tiles)
            partial[b, 0][grid] |= seen
            full[b, 0][grid] |= whole
    partial &= ~full
    return partial.astype(np.int32), full.astype(np.int32)


def ordered_blocks(dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A ``[..., rows, cols]`` 0/1 tile matrix as FlexAttention's (count, indices):
    the number of tiles per row, and the column indices with the needed tiles first
    (ascending), then the others (ascending)."""
    return dense.sum(-1).astype(np.int32), np.argsort(-dense, axis=-1, kind="stable").astype(
        np.int32
    )


def flex_mask_mod(batch: Batch, device: torch.device):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` of ``batch``'s visibility
    (``prepare_visibility``'s rule, R2, R3, R8) over the row's column indices, with
    the segment ids (and prefix keys) moved to ``device``. A caller that shards the
    columns (context parallel) evaluates it at global indices."""
    seg = host_to_device(batch.segment_ids, device)  # [B, T]
    causal = batch.causal
    in_prefix = (None if batch.prefix_len is None
                 else prefix_keys(seg, host_to_device(batch.prefix_len, device)))  # [B, T]

    def mask_mod(b, h, q_idx, kv_idx):
        same = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] != 0)
        if causal and in_prefix is None:
            same = same & (kv_idx <= q_idx)
        elif causal:
            same = same & ((kv_idx <= q_idx) | in_prefix[b, kv_idx])
        return same | (q_idx == kv_idx)

    return mask_mod


def _prepare_flex(batch: Batch, device: torch.device) -> Visibility:
    from torch.nn.attention.flex_attention import BlockMask

    B, T = batch.shape
    causal = batch.causal
    mask_mod = flex_mask_mod(batch, device)
    # the host knows no prefix lengths: a prefix segment's tiles are planned as if it
    # were bidirectional, and only wholly causal tiles count as full (exact, see doc)
    partial, full = segment_block_mask(batch.segments, T, causal,
                                       prefix=batch.prefix_len is not None)
    parts = [*ordered_blocks(partial), *ordered_blocks(full),
             *ordered_blocks(partial.swapaxes(-1, -2)), *ordered_blocks(full.swapaxes(-1, -2))]
    tensors = [host_to_device(torch.from_numpy(np.ascontiguousarray(a)), device) for a in parts]
    block_mask = BlockMask(
        (T, T), *tensors, BLOCK_SIZE=(FLEX_BLOCK_SIZE, FLEX_BLOCK_SIZE), mask_mod=mask_mod
    )
    return Visibility(impl="flex", batch_shape=(B, T), causal=causal, block_mask=block_mask)


# -------------------------------------------------------------------------- segments


def _check_segments_match_ids(batch: Batch) -> None:
    """R3: ``segments`` (host) and ``segment_ids`` describe the same rows.

    Segment k of a row (in column order) must carry id k + 1 and uncovered columns
    id 0, as documented on ``Batch``.
    """
    ids = batch.segment_ids.numpy()
    expected = np.zeros_like(ids)
    for b, row in enumerate(batch.segments):
        for k, s in enumerate(row):
            expected[b, s.start : s.stop] = k + 1
    if not np.array_equal(ids, expected):
        bad = int(np.argwhere((ids != expected).any(axis=1))[0][0])
        raise ModelError(
            f"batch row {bad}: batch.segments disagrees with batch.segment_ids (segment k "
            "must carry id k+1, padding 0); rebuild the batch with the rows compiler"
        )


def _choose_buckets(lengths: list[int], call_cost: float = _CALL_COST) -> list[int]:
    """Bucket lengths (ascending) minimising the cost model; exact dynamic programme.

    Returns the ascending list of bucket lengths; each segment goes to the smallest
    bucket that holds it. ``call_cost`` is the fixed cost of one bucket.
    """
    return _bucket_plan(lengths, call_cost)[0]


def _bucket_plan(lengths: list[int], call_cost: float) -> tuple[list[int], float]:
    """``(bucket lengths ascending, their total cost)`` for ``lengths`` (non-empty)."""
    distinct = sorted(set(lengths))
    counts = np.bincount(np.asarray(lengths), minlength=distinct[-1] + 1)
    n = len(distinct)
    # best[i]: cheapest cost covering distinct[:i]; choice[i]: start of last group.
    best = [0.0] + [float("inf")] * n
    choice = [0] * (n + 1)
    prefix = np.concatenate([[0], np.cumsum([counts[L] for L in distinct])])
    for i in range(1, n + 1):
        L = distinct[i - 1]
        per_segment = L * (L + _LINEAR_COST)
        for j in range(i):
            cost = best[j] + (prefix[i] - prefix[j]) * per_segment + call_cost
            if cost < best[i]:
                best[i], choice[i] = cost, j
    cuts, i = [], n
    while i > 0:
        cuts.append(distinct[i - 1])
        i = choice[i]
    return sorted(cuts), float(best[n])


def bucket_call_cost(threads: int) -> int:
    """The cost model's fixed cost of one bucket at ``threads`` intra-op threads
    (measured at one and two; two's is used for every count above one)."""
    return _CALL_COST if threads <= 1 else _CALL_COST_THREADED


def document_cost(threads: int) -> int:
    """The cost model's cost per document at ``threads`` intra-op threads (as above)."""
    return _DOCUMENT_COST if threads <= 1 else _DOCUMENT_COST_THREADED


def auto_costs(batch: Batch, threads: int) -> dict:
    """The cost model's figures for ``batch`` at ``threads`` intra-op threads (host data).

    ``dense`` and ``segments`` are the costs of the two CPU paths (the segments' with
    the buckets that are cheapest at ``threads``; the dense one infinite past
    ``_DENSE_MAX_PAIRS``); ``buckets`` is their number and
    ``documents`` the number of non-empty segments. A pure function of the batch's
    segment layout (``batch.shape``, ``batch.segments``) and ``threads``.
    """
    B, T = batch.shape
    lengths = [s.length for row in batch.segments for s in row if s.length]
    buckets, cost = _bucket_plan(lengths, bucket_call_cost(threads)) if lengths else ([], 0.0)
    return {
        "dense": float(B * T * (T + _LINEAR_COST)) if B * T * T <= _DENSE_MAX_PAIRS else inf,
        "segments": cost + document_cost(threads) * len(lengths),
        "buckets": len(buckets),
        "documents": len(lengths),
    }


#: Public name of the bucket choice, for other attention layouts built on the same
#: cost model (the encoder-decoder's per-pair cross-attention, ``model.encdec``).
choose_buckets = _choose_buckets


def _prepare_segments(batch: Batch, device: torch.device, call_cost: float) -> Visibility:
    B, T = batch.shape
    starts = [b * T + s.start for b, row in enumerate(batch.segments) for s in row if s.length]
    lengths = [s.length for row in batch.segments for s in row if s.length]
    prefix = None  # [B * n_seg] on the device: each segment's prefix length (prefix LM)
    if batch.prefix_len is not None:
        n_seg = batch.prefix_len.shape[1]
        entries = [b * n_seg + k for b, row in enumerate(batch.segments)
                   for k, s in enumerate(row) if s.length]  # parallel to starts/lengths
        prefix = host_to_device(batch.prefix_len, device).reshape(-1).to(torch.int64)

    none = B * T
    slot_of = np.full(B * T, -1, dtype=np.int64)
    position_of: list[np.ndarray] = []
    position_or_none: list[np.ndarray] = []
    buckets: list[_Bucket] = []
    sizes: list[int] = []
    offset = 0
    if lengths:
        bucket_lengths = _choose_buckets(lengths, call_cost)
        starts_a, lengths_a = np.asarray(starts), np.asarray(lengths)
        which = np.searchsorted(bucket_lengths, lengths_a)  # smallest bucket >= length
        for bi, L in enumerate(bucket_lengths):
            members = np.nonzero(which == bi)[0]
            if members.size == 0:
                continue
            first, n_real = starts_a[members], lengths_a[members]
            cols = np.arange(L)
            real = cols[None, :] < n_real[:, None]  # [n, L]
            reads = first[:, None] + cols[None, :]  # [n, L]
            slot_of[reads[real]] = offset + np.flatnonzero(real.reshape(-1))
            position_of.append(np.where(real, reads, first[:, None]).reshape(-1))
            position_or_none.append(np.where(real, reads, none).reshape(-1))
            key_mask = prefix_mask = None
            if not batch.causal:
                key_mask = host_to_device(torch.from_numpy(real[:, None, None, :]), device)
            elif prefix is not None:
                chosen = host_to_device(torch.from_numpy(np.asarray(entries)[members]), device)
                prefix_mask = _bucket_prefix_mask(prefix.index_select(0, chosen), int(L))
            buckets.append(_Bucket(length=int(L), count=int(members.size), key_mask=key_mask,
                                   prefix_mask=prefix_mask))
            sizes.append(int(members.size * L))
            offset += members.size * L
    padding = np.flatnonzero(slot_of < 0)  # uncovered positions see only themselves
    slot_of[padding] = offset + np.arange(padding.size)
    position_of.append(padding)
    position_or_none.append(padding)
    sizes.append(int(padding.size))

    def to_device(a: np.ndarray) -> torch.Tensor:
        return host_to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)

    return Visibility(
        impl="segments",
        batch_shape=(B, T),
        causal=batch.causal,
        buckets=tuple(buckets),
        slot_sizes=tuple(sizes),
        slot_of=to_device(slot_of),
        position_of=to_device(np.concatenate(position_of)),
        position_or_none=to_device(np.concatenate(position_or_none)),
    )


def _bucket_prefix_mask(prefix: torch.Tensor, L: int) -> torch.Tensor:
    """``[n, 1, L, L]`` bool for ``n`` segments right-padded to ``L`` columns: query
    ``i`` sees key ``j`` iff ``j <= i`` or ``j < prefix`` of its segment.

    A prefix never passes its segment's length, so no real query sees a padded key;
    a padded query sees earlier keys only (finite, discarded, zero gradient).
    """
    cols = torch.arange(L, device=prefix.device)
    causal = cols[None, :] <= cols[:, None]  # [L, L]
    in_prefix = cols[None, :] < prefix[:, None]  # [n, L] keys
    return (causal[None] | in_prefix[:, None, :])[:, None]  # [n, 1, L, L]


class _Relayout(torch.autograd.Function):
    """``out = x[index]`` whose backward is the gather ``grad[inverse]`` (no scatter).

    Exact because every element of ``x`` is read by exactly one slot whose gradient
    matters: the other reads (bucket padding) carry an exactly zero gradient, since
    causal, prefix-masked or key-masked attention gives them zero probability and
    their outputs are discarded. With ``zero_row``, ``inverse`` may hold ``len(grad)``
    to mean "no source": that gradient row is zero.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, zero_row: bool):
        ctx.save_for_backward(inverse)
        ctx.zero_row = zero_row
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        if ctx.zero_row:
            grad = torch.cat([grad, grad.new_zeros((1, *grad.shape[1:]))])
        return grad.index_select(0, inverse), None, None, None


def _attend_segments(qkv: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """Per-document SDPA: ``[B, T, 3, nH, Dh] -> [B, T, nH, Dh]``."""
    B, T, three, nH, Dh = qkv.shape
    flat = qkv.reshape(B * T, three, nH, Dh)  # free for the projection's output
    slots = _Relayout.apply(flat, vis.position_of, vis.slot_of, False)  # [S, 3, nH, Dh]
    parts = torch.split(slots, vis.slot_sizes)
    results = []
    for bucket, part in zip(vis.buckets, parts, strict=False):
        n, L = bucket.count, bucket.length
        q, k, v = (  # [n, nH, L, Dh] each
            x.transpose(1, 2) for x in part.view(n, L, three, nH, Dh).unbind(2)
        )
        mask = bucket.mask
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=vis.causal and mask is None
        )  # [n, nH, L, Dh]
        results.append(out.transpose(1, 2).reshape(n * L, nH, Dh))
    results.append(parts[-1][:, 2])  # padding sees itself only: its output is its value
    out_slots = torch.cat(results)  # [S, nH, Dh]
    out_flat = _Relayout.apply(out_slots, vis.slot_of, vis.position_or_none, True)  # [B*T, nH, Dh]
    return out_flat.view(B, T, nH, Dh)
