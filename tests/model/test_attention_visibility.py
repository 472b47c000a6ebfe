"""Attention realises Batch visibility exactly (R2, R3; issue 3 item 6).

The dense mask is checked cell by cell against the rule written out in Python; the
per-document SDPA path ("segments") and FlexAttention are checked against the dense
reference to 1e-5 in fp32, forward and gradients. Each check has a negative control.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch
from equivalence import contract_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st
from model_batches import packed_batch

from exactstep.errors import ModelError
from exactstep.model import attention as attn
from exactstep.model.attention import (
    attend,
    attend_fused,
    dense_visibility_mask,
    prepare_visibility,
)

CPU = torch.device("cpu")
TOL = 1e-5  # fp32, forward and backward (issue 3 item 6); ``tolerance`` below


def rule(seg: list[int], i: int, j: int, causal: bool) -> bool:
    """The visibility rule in words: same real segment (and j <= i if causal); padding sees itself."""
    if i == j:
        return True
    return seg[i] == seg[j] != 0 and (j <= i or not causal)


def leaky_mask(segment_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """WRONG on purpose: one causal triangle over the whole row, segments ignored."""
    B, T = segment_ids.shape
    return torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)


@st.composite
def layouts(draw, max_rows: int = 3, max_len: int = 24):
    """Rows of document lengths; each row may end with padding."""
    T = draw(st.integers(1, max_len))
    rows = []
    for _ in range(draw(st.integers(1, max_rows))):
        lengths, room = [], T
        while room > 0 and draw(st.booleans()) | (not lengths):
            n = draw(st.integers(1, room))
            lengths.append(n)
            room -= n
        rows.append(lengths)
    return rows, T


def batch_for(rows: list[list[int]], T: int, causal: bool = True):
    return packed_batch([[[1] * n for n in row] for row in rows], T, causal=causal)


def check_mask_against_rule(mask_fn, rows, T, causal) -> bool:
    batch = batch_for(rows, T, causal)
    mask = mask_fn(batch.segment_ids, causal)
    seg = batch.segment_ids.tolist()
    return all(
        bool(mask[b, 0, i, j]) == rule(seg[b], i, j, causal)
        for b in range(len(rows))
        for i, j in itertools.product(range(T), range(T))
    )


@settings(max_examples=40, deadline=None)
@given(layouts(max_len=12), st.booleans())
def test_dense_mask_is_the_rule(layout, causal):
    rows, T = layout
    assert check_mask_against_rule(dense_visibility_mask, rows, T, causal)


def test_dense_rule_check_catches_a_leaky_mask():
    # Negative control: two documents in one row; the leaky mask lets the second see the first.
    assert not check_mask_against_rule(leaky_mask, [[3, 4]], 8, True)


def attention_and_grads(batch, impl: str, seed: int = 0, vis=None, nH: int = 2, Dh: int = 8,
                        dtype=torch.float32):
    """Output and q/k/v gradients of attention under ``impl`` on fixed random inputs
    (drawn in fp32, then taken to ``dtype``)."""
    B, T = batch.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, nH, T, Dh, generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    upstream = torch.randn(B, nH, T, Dh, generator=g).to(dtype)
    vis = vis if vis is not None else prepare_visibility(batch, impl, CPU)
    out = attend(q, k, v, vis)
    (out * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def fused_attention_and_grads(batch, impl: str, seed: int = 0, nH: int = 2, Dh: int = 8):
    """The decoder's layout: ``attend_fused(qkv [B, T, 3, nH, Dh])``; same inputs as above."""
    B, T = batch.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, nH, T, Dh, generator=g) for _ in range(3))
    upstream = torch.randn(B, nH, T, Dh, generator=g)
    qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2).requires_grad_()
    out = attend_fused(qkv, prepare_visibility(batch, impl, CPU))  # [B, T, nH, Dh]
    (out.transpose(1, 2) * upstream).sum().backward()
    grads = [x.transpose(1, 2) for x in qkv.grad.unbind(2)]
    return [out.detach().transpose(1, 2), *grads]


def tolerance(batch, reference, seed: int = 0) -> float:
    """``TOL`` (the contract: fp32 rounds these O(1) outputs and gradients to ~1e-7), or
    twice the dense reference's own distance from dense attention in float64 where that
    is larger (``contract_tolerance``)."""
    return contract_tolerance(TOL, reference,
                              attention_and_grads(batch, "dense", seed, dtype=torch.float64))


def max_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(layouts(), st.booleans(), st.integers(0, 2**16))
def test_segments_equal_dense_forward_and_backward(layout, causal, seed):
    rows, T = layout
    batch = batch_for(rows, T, causal)
    reference = attention_and_grads(batch, "dense", seed)
    candidate = attention_and_grads(batch, "segments", seed)
    tol = tolerance(batch, reference, seed)
    assert max_error(candidate, reference) <= tol
    assert all(torch.isfinite(t).all() for t in candidate)
    for impl in ("segments", "dense"):  # the decoder's fused layout agrees too
        assert max_error(fused_attention_and_grads(batch, impl, seed), reference) <= tol


@pytest.mark.parametrize("causal", [True, False])
def test_whole_rows_take_the_plain_path_and_equal_dense(causal):
    batch = batch_for([[10], [10], [10]], 10, causal)
    assert prepare_visibility(batch, "segments", CPU).whole_rows
    reference = attention_and_grads(batch, "dense")
    tol = tolerance(batch, reference)
    assert max_error(attention_and_grads(batch, "segments"), reference) <= tol
    assert max_error(fused_attention_and_grads(batch, "segments"), reference) <= tol


def test_segments_check_catches_a_wrong_variant():
    # Negative control: right-padding a segment to its bucket is exact only under the
    # causal flag; the same gather run without it lets queries see later/padded columns.
    batch = batch_for([[5, 2, 7], [3, 3]], 16)
    vis = prepare_visibility(batch, "segments", CPU)
    wrong = dataclasses.replace(vis, causal=False)
    reference = attention_and_grads(batch, "dense")
    assert max_error(attention_and_grads(batch, "segments", vis=vis), reference) <= tolerance(
        batch, reference)
    assert max_error(attention_and_grads(batch, "segments", vis=wrong), reference) > 1e-2


def test_dense_check_catches_leaky_visibility():
    # Negative control for the comparison itself: the leaky mask is not the reference.
    batch = batch_for([[5, 2, 7]], 16)
    leaky = attn.Visibility(
        impl="dense",
        batch_shape=(1, 16),
        causal=True,
        dense_mask=leaky_mask(batch.segment_ids, True),
    )
    assert (
        max_error(
            attention_and_grads(batch, "dense", vis=leaky), attention_and_grads(batch, "dense")
        )
        > 1e-2
    )


@pytest.mark.parametrize("impl", ["dense", "segments"])
def test_padding_queries_see_only_themselves(impl):
    batch = batch_for([[4], [6, 3]], 12)  # row 0: 8 padding columns, row 1: 3
    B, T = batch.shape
    q, k, v = (torch.randn(B, 2, T, 4) for _ in range(3))
    out = attend(q, k, v, prepare_visibility(batch, impl, CPU))
    pad = batch.segment_ids == 0  # [B, T]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.transpose(1, 2)[pad], v.transpose(1, 2)[pad], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["dense", "segments"])
def test_a_document_is_blind_to_its_neighbours(impl):
    # Perturb document A's values: document B's outputs must not move (R3, A1 probe).
    batch = batch_for([[5, 6]], 12)
    q, k, v = (torch.randn(1, 2, 12, 4) for _ in range(3))
    vis = prepare_visibility(batch, impl, CPU)
    v2 = v.clone()
    v2[:, :, :5] += 10.0
    before, after = attend(q, k, v, vis), attend(q, k, v2, vis)
    torch.testing.assert_close(before[:, :, 5:], after[:, :, 5:], rtol=0, atol=0)
    assert not torch.allclose(before[:, :, :5], after[:, :, :5])


@pytest.mark.filterwarnings("ignore")
def test_flex_forward_equals_dense_on_cpu_without_grad():
    batch = batch_for([[3, 7, 2], [11], [5, 5]], 16)
    q, k, v = (torch.randn(3, 2, 16, 8) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, prepare_visibility(batch, "flex", CPU))
        dense = attend(q, k, v, prepare_visibility(batch, "dense", CPU))
        exact = attend(q.double(), k.double(), v.double(), prepare_visibility(batch, "dense", CPU))
    torch.testing.assert_close(flex, dense, rtol=0, atol=contract_tolerance(TOL, [dense], [exact]))


def test_flex_training_on_cpu_is_refused_with_a_fix():
    batch = batch_for([[3]], 4)
    with pytest.raises(ModelError, match="model.attention"):
        prepare_visibility(batch, "flex", CPU)


def test_auto_picks_segments_on_cpu_and_unknown_impl_is_refused():
    assert attn.resolve_impl("auto", CPU) == "segments"
    assert attn.resolve_impl("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ModelError, match="model.attention"):
        prepare_visibility(batch_for([[3]], 4), "triangle", CPU)


def test_segments_disagreeing_with_segment_ids_are_refused():
    batch = batch_for([[3, 4]], 8)
    wrong = dataclasses.replace(batch, segments=(batch.segments[0][:1],))  # forgets a document
    with pytest.raises(ModelError, match="row 0"):
        prepare_visibility(wrong, "segments", CPU)


def bucket_cost(lengths: list[int], buckets: list[int]) -> float:
    cost = attn._CALL_COST * len({min(b for b in buckets if b >= n) for n in lengths})
    for n in lengths:
        L = min(b for b in buckets if b >= n)
        cost += L * (L + attn._LINEAR_COST)
    return cost


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=7))
def test_bucket_choice_is_optimal_and_covers_every_length(lengths):
    chosen = attn._choose_buckets(lengths)
    assert max(chosen) == max(lengths)  # every segment fits
    distinct = sorted(set(lengths))
    # Brute force over every subset of distinct lengths that keeps the maximum.
    best = min(
        bucket_cost(lengths, list(subset) + [distinct[-1]])
        for r in range(len(distinct))
        for subset in itertools.combinations(distinct[:-1], r)
    )
    assert bucket_cost(lengths, chosen) == pytest.approx(best)


def test_visibility_from_another_batch_is_refused():
    vis = prepare_visibility(batch_for([[3, 4]], 8), "segments", CPU)
    q = torch.randn(1, 2, 9, 4)
    with pytest.raises(ModelError, match="same batch"):
        attend(q, q, q, vis)
