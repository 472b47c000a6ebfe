"""CUDA paths (skipped without a GPU): FlexAttention and per-document SDPA train
exactly like the dense reference (R3, issue 2 item 5). fp32, 1e-5 for the
per-document path; FlexAttention accumulates in another order, so 1e-4 there.
"""

from __future__ import annotations

import pytest
import torch
from model_batches import fill_rows, packed_batch

from exactstep.model.attention import attend, prepare_visibility
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import IGNORE_INDEX

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA = torch.device("cuda")


def grads_of(batch, impl: str):
    B, T = batch.shape
    g = torch.Generator(device=CUDA).manual_seed(0)
    q, k, v = (
        torch.randn(B, 2, T, 16, generator=g, device=CUDA).requires_grad_() for _ in range(3)
    )
    out = attend(q, k, v, prepare_visibility(batch.to(CUDA), impl, CUDA))
    out.square().sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("impl,tol", [("segments", 1e-5), ("flex", 1e-4)])
def test_cuda_paths_equal_dense_forward_and_backward(impl, tol):
    batch = packed_batch([[[1] * n for n in row] for row in [[5, 9, 3], [12], [2, 2, 2]]], 20)
    reference = grads_of(batch, "dense")
    candidate = grads_of(batch, impl)
    assert max(float((a - b).abs().max()) for a, b in zip(candidate, reference, strict=True)) <= tol


def test_auto_is_flex_on_cuda_and_the_decoder_trains():
    model = build_model(ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48), 37, seed=0)
    model = model.to(CUDA)
    batch = packed_batch(fill_rows([[5, 9], [12]], 37), 16).to(CUDA)
    logits = model.logits(model(batch))
    supervised = batch.labels != IGNORE_INDEX
    loss = torch.nn.functional.cross_entropy(logits[supervised], batch.labels[supervised])
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_host_block_mask_equals_create_block_mask_on_cuda_and_flex_trains_like_dense():
    """Several 128-tiles per row, so the kernel skips some tiles and applies no
    mask_mod on full ones: the tiles must be exactly right (issue 16 item 7)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = packed_batch([[[1] * n for n in row] for row in [[290], [40, 200, 30], [7, 260]]],
                         300).to(CUDA)
    vis = prepare_visibility(batch, "flex", CUDA, head_dim=16)
    seg = batch.segment_ids

    def mask_mod(b, h, q, k):
        return ((seg[b, q] == seg[b, k]) & (seg[b, q] != 0) & (k <= q)) | (q == k)

    ref = create_block_mask(mask_mod, 3, None, 300, 300, device="cuda")
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(vis.block_mask, name), getattr(ref, name)), name
    reference = grads_of(batch, "dense")
    candidate = grads_of(batch, "flex")
    assert max(float((a - b).abs().max()) for a, b in zip(candidate, reference, strict=True)) <= 1e-4


def test_flex_below_head_dim_16_is_refused_and_auto_falls_back():
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=16), 37, seed=0)
    model = model.to(CUDA)  # head dim 8: compiled FlexAttention cannot run
    batch = packed_batch(fill_rows([[5, 9], [12]], 37), 16).to(CUDA)
    logits = model.logits(model(batch))  # auto -> per-document SDPA
    logits.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
