"""How attention is chosen and built for CUDA, checked on the CPU (issue 16 items 1, 6, 7).

- ``auto`` never picks FlexAttention below head dimension 16 (compiled FlexAttention
  cannot run there); an explicit ``flex`` is refused on CUDA with the fix named.
- Whole-document rows take plain causal SDPA under ``flex`` and ``auto``, so greedy
  decoding (a growing length) never reaches FlexAttention.
- The FlexAttention block mask is built on the host from the segments: the same
  tiles as PyTorch's ``create_block_mask`` (which materialises ``[B, H, T, T]``),
  without calling it, and FlexAttention under it equals the dense reference.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from equivalence import contract_tolerance
from model_batches import packed_batch

from exactstep.errors import ModelError
from exactstep.eval import _greedy_continue
from exactstep.model import attention as attn
from exactstep.model import decoder as decoder_module
from exactstep.model.attention import attend, prepare_visibility, resolve_impl
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # CUDA only as a value: nothing runs there
TOL = 1e-5


def batch_for(rows: list[list[int]], T: int, causal: bool = True):
    return packed_batch([[[1] * n for n in row] for row in rows], T, causal=causal)


# ------------------------------------------------------------------ item 1: the chooser


@pytest.mark.parametrize("head_dim,expected", [(2, "segments"), (8, "segments"),
                                               (15, "segments"), (16, "flex"), (64, "flex"),
                                               (None, "flex")])
def test_auto_on_cuda_needs_head_dim_16_for_flex(head_dim, expected):
    assert resolve_impl("auto", CUDA, head_dim) == expected
    assert resolve_impl("auto", CPU, head_dim) == "segments"  # the CPU never picks flex


def test_explicit_flex_below_16_on_cuda_is_refused_naming_the_fix():
    with pytest.raises(ModelError, match=r"at least 16 on CUDA; got 8.*'auto' or 'segments'"):
        resolve_impl("flex", CUDA, 8)
    # refused before anything touches a device: the batch is prepared for CUDA on a CPU host
    with pytest.raises(ModelError, match="model.n_heads"):
        prepare_visibility(batch_for([[3, 4]], 8), "flex", CUDA, head_dim=8)
    assert resolve_impl("flex", CUDA, 16) == "flex"
    assert resolve_impl("flex", CPU, 8) == "flex"  # CPU FlexAttention (no grad) has no limit


def test_the_decoder_tells_the_chooser_its_head_dim(monkeypatch):
    seen = []
    real = decoder_module.prepare_visibility

    def spy(batch, impl, device, *, head_dim=None):
        seen.append(head_dim)
        return real(batch, impl, device, head_dim=head_dim)

    monkeypatch.setattr(decoder_module, "prepare_visibility", spy)
    model = build_model(ModelConfig(d_model=24, n_heads=3, n_layers=1, d_ff=16), 11, seed=0)
    model(batch_for([[3, 4]], 8))
    assert seen == [8]


# ------------------------------------------------- item 6: whole rows never reach flex


def test_whole_rows_take_plain_sdpa_under_flex_and_auto_even_for_cuda():
    batch = batch_for([[9], [9]], 9)
    for impl, device in (("auto", CUDA), ("flex", CUDA), ("flex", CPU), ("segments", CPU)):
        with torch.no_grad():
            vis = prepare_visibility(batch, impl, device, head_dim=32)
        assert vis.whole_rows and vis.impl == "segments" and vis.block_mask is None, impl
    # a packed row is not whole: flex keeps its block mask (negative control of the test)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = prepare_visibility(batch_for([[4, 5]], 9), "flex", CPU)
    assert packed.impl == "flex" and packed.block_mask is not None


def test_greedy_decoding_never_calls_flex_attention(monkeypatch):
    """Each decoding step is one longer: with whole rows no FlexAttention call (and so no
    recompilation per length) happens, even when the model asks for ``flex``."""
    calls = []

    def no_flex():
        calls.append(1)
        raise AssertionError("FlexAttention was called")

    monkeypatch.setattr(attn, "_flex_attention", no_flex)
    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1, d_ff=16,
                                    attention="flex"), 13, seed=0)
    prompts = torch.randint(0, 12, (3, 5))
    answers = _greedy_continue(model, prompts, eos_id=12, max_new_tokens=6)
    assert len(answers) == 3 and calls == []
    with torch.no_grad(), pytest.raises(AssertionError, match="FlexAttention was called"):
        model(batch_for([[2, 3]], 5))  # negative control: a packed row does reach it
    assert calls == [1]


# --------------------------------------------- item 7: the block mask without [T, T]


def flex_mask_mod(batch):
    seg, causal = batch.segment_ids, batch.causal

    def mask_mod(b, h, q, k):
        same = (seg[b, q] == seg[b, k]) & (seg[b, q] != 0)
        if causal:
            same = same & (k <= q)
        return same | (q == k)

    return mask_mod


def random_layout(rng: random.Random) -> tuple[list[list[int]], int]:
    T = rng.randint(1, 90)
    rows = []
    for _ in range(rng.randint(1, 3)):
        lengths, room = [], T
        while room > 0 and (not lengths or rng.random() < 0.7):
            n = rng.randint(1, room)
            lengths.append(n)
            room -= n
        rows.append(lengths)
    return rows, T


def host_tiles(batch, T, block):
    partial, full = attn.segment_block_mask(batch.segments, T, batch.causal, block)
    return [*attn.ordered_blocks(partial), *attn.ordered_blocks(full),
            *attn.ordered_blocks(partial.swapaxes(-1, -2)),
            *attn.ordered_blocks(full.swapaxes(-1, -2))]


def torch_tiles(batch, T, block):
    from torch.nn.attention.flex_attention import create_block_mask

    ref = create_block_mask(flex_mask_mod(batch), batch.shape[0], None, T, T, device="cpu",
                            BLOCK_SIZE=block)
    return [t.numpy() for t in (ref.kv_num_blocks, ref.kv_indices, ref.full_kv_num_blocks,
                                ref.full_kv_indices, ref.q_num_blocks, ref.q_indices,
                                ref.full_q_num_blocks, ref.full_q_indices)]


def test_host_block_mask_has_exactly_create_block_masks_tiles():
    rng = random.Random(0)
    for _ in range(40):
        rows, T = random_layout(rng)
        block = rng.choice([4, 8, 16])
        batch = batch_for(rows, T, causal=rng.random() < 0.7)
        for mine, theirs in zip(host_tiles(batch, T, block), torch_tiles(batch, T, block),
                                strict=True):
            assert np.array_equal(mine, theirs), (rows, T, block, batch.causal)


def test_tile_check_catches_a_causality_blind_mask():
    """Negative control: tiles computed as if the rows were bidirectional differ."""
    batch = batch_for([[20, 12], [32]], 32)
    wrong = batch_for([[20, 12], [32]], 32, causal=False)
    assert any(not np.array_equal(a, b)
               for a, b in zip(host_tiles(wrong, 32, 8), torch_tiles(batch, 32, 8), strict=True))


def flex_and_dense(batch, vis=None):
    B, T = batch.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, T, 16, generator=g) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, vis if vis is not None else prepare_visibility(batch, "flex", CPU))
        dense_vis = prepare_visibility(batch, "dense", CPU)
        dense = attend(q, k, v, dense_vis)
        exact = attend(q.double(), k.double(), v.double(), dense_vis)
    return flex, dense, exact


def test_flex_under_the_host_mask_equals_dense_and_builds_no_dense_mask(monkeypatch):
    """Several 128-tiles per row (T = 300): full, partial and skipped tiles all occur.

    On the CPU FlexAttention's eager path applies ``mask_mod`` to every pair, so this
    checks the ``mask_mod`` and that preparing builds no dense mask; the tiles
    themselves are checked against ``create_block_mask`` above (and on CUDA, where the
    kernel skips tiles, by the CUDA tests)."""
    import torch.nn.attention.flex_attention as fa

    def refuse(*args, **kwargs):
        raise AssertionError("a dense [B, H, T, T] mask was built")

    monkeypatch.setattr(fa, "create_mask", refuse)
    monkeypatch.setattr(fa, "create_block_mask", refuse)
    batch = batch_for([[290], [40, 200, 30], [7, 260]], 300)
    with torch.no_grad():
        vis = prepare_visibility(batch, "flex", CPU)
    counts = vis.block_mask.full_kv_num_blocks.sum(), vis.block_mask.kv_num_blocks.sum()
    assert all(int(c) > 0 for c in counts)  # some tiles skip the mask_mod, some apply it
    flex, dense, exact = flex_and_dense(batch, vis)
    # R3's 1e-5, or twice dense fp32's own distance from float64 were that larger (sums
    # of up to 300 products: a worst case of gamma(300) |v| ~ 7e-5)
    torch.testing.assert_close(flex, dense, rtol=0, atol=contract_tolerance(TOL, [dense], [exact]))
