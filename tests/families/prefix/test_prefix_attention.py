"""Prefix LM visibility in every attention path, and in the decoder (R2, R3, R8).

The dense mask is checked against a hand-written one and, cell by cell, against the
pure-Python rule (``families.prefix.reference.visible``); the per-document path equals
dense to 1e-5 forward and backward (fp32); FlexAttention equals dense forward on the
CPU (no FlexAttention backward there; the CUDA test does both). Through the decoder:
packed prefix rows equal each document alone (1e-5), and no supervised row's logits
move when the token it predicts, or any later one, is changed. Each check has a
negative control that must fail it.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from equivalence import contract_tolerance, equivalence_error
from hypothesis import given, settings
from hypothesis import strategies as st
from model.model_batches import fill_rows, packed_batch

from exactstep.data.arith import arith_conversations
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ModelError
from exactstep.families.prefix import reference as oracle
from exactstep.families.prefix.compiler import compile_prefix_batch
from exactstep.model import attention as attn
from exactstep.model.attention import (
    Visibility,
    attend,
    attend_fused,
    dense_visibility_mask,
    prefix_keys,
    prepare_visibility,
)
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.rows.packing import Piece

CPU = torch.device("cpu")
#: R3 (fp32): attention outputs and gradients on N(0, 1) inputs are O(1) and round to
#: ~1e-7; the checks take twice fp32's own spread from float64 where that is larger
TOL = 1e-5


def with_prefix(batch, prefix: list[list[int]]):
    width = max(1, max(len(p) for p in prefix))
    rows = [p + [0] * (width - len(p)) for p in prefix]
    return dataclasses.replace(batch, prefix_len=torch.tensor(rows, dtype=torch.int64))


def prefixed(rows: list[list[int]], prefix: list[list[int]], T: int):
    return with_prefix(packed_batch([[[1] * n for n in row] for row in rows], T), prefix)


@st.composite
def prefix_layouts(draw, max_rows: int = 3, max_len: int = 24):
    """Rows of document lengths (padding may follow), each with a prefix in [0, length]."""
    T = draw(st.integers(1, max_len))
    rows, prefix = [], []
    for _ in range(draw(st.integers(1, max_rows))):
        lengths, room = [], T
        while room > 0 and (draw(st.booleans()) or not lengths):
            n = draw(st.integers(1, room))
            lengths.append(n)
            room -= n
        rows.append(lengths)
        prefix.append([draw(st.integers(0, n)) for n in lengths])
    return rows, prefix, T


# ------------------------------------------------------------------------------ dense


def test_dense_prefix_mask_is_the_hand_written_one():
    # one row: a segment of 4 with a prefix of 3, a segment of 3 with none, 1 padding
    batch = prefixed([[4, 3]], [[3, 0]], 8)
    o, x = 0, 1
    written = [
        [x, x, x, o, o, o, o, o],
        [x, x, x, o, o, o, o, o],
        [x, x, x, o, o, o, o, o],
        [x, x, x, x, o, o, o, o],
        [o, o, o, o, x, o, o, o],
        [o, o, o, o, x, x, o, o],
        [o, o, o, o, x, x, x, o],
        [o, o, o, o, o, o, o, x],
    ]
    mask = dense_visibility_mask(batch.segment_ids, True, batch.prefix_len)
    assert mask[0, 0].int().tolist() == written
    assert prefix_keys(batch.segment_ids, batch.prefix_len).int().tolist() == [[1, 1, 1, 0, 0,
                                                                                0, 0, 0]]


def matches_rule(mask: torch.Tensor, batch) -> bool:
    return all(
        mask[b, 0].tolist() == oracle.visible(batch.segment_ids[b].tolist(),
                                              batch.prefix_len[b].tolist())
        for b in range(batch.shape[0]))


@settings(max_examples=40, deadline=None)
@given(prefix_layouts(max_len=12))
def test_dense_prefix_mask_is_the_rule(layout):
    rows, prefix, T = layout
    batch = prefixed(rows, prefix, T)
    assert matches_rule(dense_visibility_mask(batch.segment_ids, True, batch.prefix_len), batch)


def test_the_rule_check_catches_prefixes_seen_across_documents():
    # Negative control: prefix keys visible to every query of the row, segments ignored.
    batch = prefixed([[4, 3]], [[3, 2]], 8)
    seg = batch.segment_ids
    real = (seg[:, :, None] != 0) & (seg[:, None, :] != 0)
    leaky = dense_visibility_mask(seg, True, batch.prefix_len) | (
        real & prefix_keys(seg, batch.prefix_len)[:, None, :])[:, None]
    assert not matches_rule(leaky, batch)


# ------------------------------------------------------------------------------ segments


def attention_and_grads(batch, impl: str, seed: int = 0, vis=None, dtype=torch.float32):
    B, T = batch.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, T, 8, generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    upstream = torch.randn(B, 2, T, 8, generator=g).to(dtype)
    vis = vis if vis is not None else prepare_visibility(batch, impl, CPU)
    out = attend(q, k, v, vis)
    (out * upstream).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def fused_attention_and_grads(batch, impl: str, seed: int = 0):
    B, T = batch.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, 2, T, 8, generator=g) for _ in range(3))
    upstream = torch.randn(B, 2, T, 8, generator=g)
    qkv = torch.stack([x.transpose(1, 2) for x in (q, k, v)], dim=2).requires_grad_()
    out = attend_fused(qkv, prepare_visibility(batch, impl, CPU))
    (out.transpose(1, 2) * upstream).sum().backward()
    return [out.detach().transpose(1, 2), *(x.transpose(1, 2) for x in qkv.grad.unbind(2))]


def tolerance(batch, reference, seed: int = 0) -> float:
    """``TOL`` (the contract: fp32 rounds these O(1) outputs and gradients to ~1e-7), or
    twice the dense reference's own distance from dense attention in float64 where that
    is larger (``contract_tolerance``)."""
    return contract_tolerance(TOL, reference,
                              attention_and_grads(batch, "dense", seed, dtype=torch.float64))


def max_error(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@settings(max_examples=40, deadline=None)
@given(prefix_layouts(), st.integers(0, 2**16))
def test_segments_equal_dense_with_prefixes_forward_and_backward(layout, seed):
    rows, prefix, T = layout
    batch = prefixed(rows, prefix, T)
    reference = attention_and_grads(batch, "dense", seed)
    candidate = attention_and_grads(batch, "segments", seed)
    tol = tolerance(batch, reference, seed)
    assert max_error(candidate, reference) <= tol
    assert all(torch.isfinite(t).all() for t in candidate)
    assert max_error(fused_attention_and_grads(batch, "segments", seed), reference) <= tol


def test_segments_without_the_prefix_masks_is_caught():
    # Negative control: the same buckets run causally (prefix masks dropped). The
    # lengths make several buckets, each with its own segments' prefixes.
    batch = prefixed([[150], [10] * 10 + [7, 2]], [[80], [3, 10, 0, 1, 5, 9, 2, 2, 4, 6, 7, 1]],
                     150)
    vis = prepare_visibility(batch, "segments", CPU)
    assert len(vis.buckets) >= 2 and all(b.prefix_mask is not None for b in vis.buckets)
    wrong = dataclasses.replace(vis, buckets=tuple(dataclasses.replace(b, prefix_mask=None)
                                                   for b in vis.buckets))
    reference = attention_and_grads(batch, "dense")
    assert max_error(attention_and_grads(batch, "segments", vis=vis), reference) <= tolerance(
        batch, reference)
    assert max_error(attention_and_grads(batch, "segments", vis=wrong), reference) > 1e-2


def test_whole_rows_with_a_prefix_leave_the_plain_causal_path_and_equal_dense():
    batch = prefixed([[10], [10]], [[4], [7]], 10)
    for impl in ("segments", "auto"):
        vis = prepare_visibility(batch, impl, CPU)
        assert not vis.whole_rows and vis.impl == "segments"
    with torch.no_grad():  # flex too takes the masked per-document path for whole rows
        assert prepare_visibility(batch, "flex", CPU).impl == "segments"
    reference = attention_and_grads(batch, "dense")
    assert max_error(attention_and_grads(batch, "segments"), reference) <= tolerance(
        batch, reference)
    # the plain path is kept for whole rows without a prefix (and is wrong here)
    plain = prepare_visibility(dataclasses.replace(batch, prefix_len=None), "segments", CPU)
    assert plain.whole_rows
    assert max_error(attention_and_grads(batch, "segments", vis=plain), reference) > 1e-2


def test_prefixes_of_zero_or_one_are_causal():
    rows = [[5, 2, 7], [3, 3]]
    batch = prefixed(rows, [[1, 0, 1], [0, 1]], 16)
    causal = packed_batch([[[1] * n for n in row] for row in rows], 16)
    reference = attention_and_grads(causal, "dense")
    assert max_error(attention_and_grads(batch, "segments"), reference) <= tolerance(
        causal, reference)


# ------------------------------------------------------------------------------ flex


@pytest.mark.filterwarnings("ignore")
def test_flex_with_prefixes_equals_dense_on_cpu_without_grad():
    batch = prefixed([[3, 7, 2], [11], [5, 5]], [[3, 5, 0], [6], [1, 4]], 16)
    q, k, v = (torch.randn(3, 2, 16, 8) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, prepare_visibility(batch, "flex", CPU))
        dense = attend(q, k, v, prepare_visibility(batch, "dense", CPU))
        exact = attend(q.double(), k.double(), v.double(), prepare_visibility(batch, "dense", CPU))
        causal = attend(q, k, v, prepare_visibility(dataclasses.replace(batch, prefix_len=None),
                                                    "flex", CPU))
    torch.testing.assert_close(flex, dense, rtol=0, atol=contract_tolerance(TOL, [dense], [exact]))
    assert float((causal - dense).abs().max()) > 1e-2  # negative control: prefix ignored


def tiles(mask: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(any visible, all visible) per tile of a ``[T, T]`` mask, columns past T invisible."""
    T = mask.shape[0]
    n = -(-T // block)
    padded = np.zeros((n * block, n * block), dtype=bool)
    padded[:T, :T] = mask
    blocks = padded.reshape(n, block, n, block).transpose(0, 2, 1, 3)
    return blocks.any(axis=(2, 3)), blocks.all(axis=(2, 3))


def test_the_host_block_mask_covers_every_prefix_pair_and_never_skips_a_masked_one():
    """Needed tiles (partial or full) include every tile with a visible pair; full
    tiles are wholly visible, so skipping the mask_mod there is exact."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        T = int(rng.integers(1, 60))
        rows, prefix = [], []
        for _ in range(int(rng.integers(1, 3))):
            cuts = sorted(set(rng.integers(1, T + 1, size=int(rng.integers(1, 4))).tolist()))
            lengths = np.diff([0, *cuts]).tolist()
            rows.append(lengths)
            prefix.append([int(rng.integers(0, n + 1)) for n in lengths])
        batch = prefixed(rows, prefix, T)
        block = int(rng.choice([4, 8]))
        partial, full = attn.segment_block_mask(batch.segments, T, True, block, prefix=True)
        dense = dense_visibility_mask(batch.segment_ids, True, batch.prefix_len).numpy()
        for b in range(len(rows)):
            seen, whole = tiles(dense[b, 0], block)
            assert not (seen & ~(partial[b, 0] | full[b, 0]).astype(bool)).any()
            assert not (full[b, 0].astype(bool) & ~whole).any()
    # negative control: the causal plan (prefix=False) misses tiles a prefix needs
    batch = prefixed([[12]], [[12]], 12)
    partial, full = attn.segment_block_mask(batch.segments, 12, True, 4)
    seen, _ = tiles(dense_visibility_mask(batch.segment_ids, True, batch.prefix_len)[0, 0]
                    .numpy(), 4)
    assert (seen & ~(partial[0, 0] | full[0, 0]).astype(bool)).any()


# ------------------------------------------------------------------------------ refusals


def test_malformed_prefix_lengths_are_refused():
    batch = prefixed([[3, 4]], [[3, 4]], 8)
    with pytest.raises(ModelError, match="already bidirectional"):
        prepare_visibility(dataclasses.replace(batch, causal=False), "segments", CPU)
    with pytest.raises(ModelError, match=r"row 0 segment 2: prefix_len 5 is outside \[0, 4\]"):
        prepare_visibility(with_prefix(batch, [[3, 5]]), "dense", CPU)
    with pytest.raises(ModelError, match="n_seg >= 2"):
        prepare_visibility(with_prefix(batch, [[3]]), "segments", CPU)


# ------------------------------------------------------------------------------ the decoder

VOCAB = 37
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, attention="segments")


def decoder(attention: str = "segments"):
    return build_model(dataclasses.replace(MODEL, attention=attention), VOCAB, seed=0)


def prefix_docs_batch(docs: list[list[list[int]]], prefix: list[list[int]], T: int):
    return with_prefix(packed_batch(docs, T), prefix)


def leaky_visibility(batch) -> Visibility:
    """WRONG on purpose: prefix keys of one document visible to the whole row."""
    seg = batch.segment_ids
    real = (seg[:, :, None] != 0) & (seg[:, None, :] != 0)
    mask = dense_visibility_mask(seg, True, batch.prefix_len) | (
        real & prefix_keys(seg, batch.prefix_len)[:, None, :])[:, None]
    return Visibility(impl="dense", batch_shape=batch.shape, causal=True, dense_mask=mask)


def packed_run(model, docs, prefix, T, make_vis=None):
    batch = prefix_docs_batch(docs, prefix, T)
    model.zero_grad()
    logits = model.logits(model(batch, visibility=make_vis(batch) if make_vis else None))
    supervised = batch.labels != IGNORE_INDEX
    loss = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
    (loss / supervised.sum()).backward()
    per_doc = [logits[b, s.start:s.stop].detach() for b, row in enumerate(batch.segments)
               for s in row]
    return per_doc, loss.detach() / supervised.sum(), {n: p.grad.clone()
                                                       for n, p in model.named_parameters()}


def separate_run(model, docs, prefix):
    flat = [(d, p) for row, ps in zip(docs, prefix, strict=True) for d, p in zip(row, ps,
                                                                               strict=True)]
    total = sum(len(d) - 1 for d, _ in flat)
    model.zero_grad()
    per_doc, loss = [], torch.zeros(())
    for doc, p in flat:
        batch = prefix_docs_batch([[doc]], [[p]], len(doc))
        logits = model.logits(model(batch))
        supervised = batch.labels != IGNORE_INDEX
        part = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
        (part / total).backward()
        per_doc.append(logits[0].detach())
        loss = loss + part.detach() / total
    return per_doc, loss, {n: p.grad.clone() for n, p in model.named_parameters()}




DOCS = fill_rows([[5, 9, 3], [12, 4], [2, 7]], VOCAB, seed=1)
DOC_PREFIX = [[3, 4, 1], [12, 0], [2, 5]]


@pytest.mark.parametrize("attention", ["segments", "dense"])
def test_packed_prefix_rows_equal_each_document_alone(attention):
    model = decoder(attention)
    packed = packed_run(model, DOCS, DOC_PREFIX, 18)
    assert equivalence_error(packed, separate_run(model, DOCS, DOC_PREFIX)) <= TOL


def test_packed_equivalence_catches_prefixes_leaking_across_documents():
    model = decoder()
    leaky = packed_run(model, DOCS, DOC_PREFIX, 18, make_vis=leaky_visibility)
    assert equivalence_error(leaky, separate_run(model, DOCS, DOC_PREFIX)) > 1e-3


def arith_batch():
    """Two rows of packed arithmetic conversations, compiled by the prefix compiler."""
    tokenizer = ByteTokenizer()
    examples, _ = chat_examples(arith_conversations(0, 4, split="train"), tokenizer,
                                ChatPolicy(), max_len=64)
    rows = [[Piece(0, 0, len(examples[0]), 0), Piece(1, 0, 20, 0)],
            [Piece(2, 0, len(examples[2]), 0)]]
    T = max(sum(p.length for p in row) for row in rows) + 2
    return compile_prefix_batch(rows, examples, seq_len=T, pad_id=tokenizer.pad_id), tokenizer


def perturbed_copies(batch, b: int):
    """Row ``b`` unchanged, then one copy per real column ``j`` with the input at ``j``
    changed (one batch, so every copy is computed exactly like the unchanged row)."""
    columns = [j for j in range(batch.shape[1]) if int(batch.segment_ids[b, j]) != 0]
    n = len(columns) + 1
    ids = batch.input_ids[b].repeat(n, 1)
    changed = torch.arange(1, n)
    ids[changed, columns] = (ids[changed, columns] + 1) % VOCAB
    copies = dataclasses.replace(
        batch, input_ids=ids, labels=batch.labels[b].repeat(n, 1),
        position_ids=batch.position_ids[b].repeat(n, 1),
        segment_ids=batch.segment_ids[b].repeat(n, 1), segments=(batch.segments[b],) * n,
        prefix_len=batch.prefix_len[b].repeat(n, 1))
    return columns, copies


def rows_blind_to_their_future(model, batch) -> bool:
    """Changing the input at column j must leave exactly unchanged the logits of every
    supervised row i < j of the same segment (row i predicts column i + 1): no row's
    prediction may depend on the token it predicts or a later one."""
    with torch.no_grad():
        supervised = batch.labels != IGNORE_INDEX
        for b in range(batch.shape[0]):
            columns, copies = perturbed_copies(batch, b)
            logits = model.logits(model(copies))  # [1 + columns, T, V]
            for copy, j in enumerate(columns, start=1):
                seg = batch.segment_ids[b, j]
                earlier = supervised[b] & (batch.segment_ids[b] == seg)
                earlier[j:] = False
                if not torch.equal(logits[copy, earlier], logits[0, earlier]):
                    return False
    return True


def test_no_supervised_row_depends_on_its_target_or_later_tokens():
    batch, tokenizer = arith_batch()
    model = build_model(MODEL, VOCAB, seed=0)
    batch = dataclasses.replace(batch, input_ids=batch.input_ids % VOCAB)  # a small vocabulary
    assert rows_blind_to_their_future(model, batch)
    # negative controls: the prefix reaching the first answer token, the whole segment
    # bidirectional, and a compiler that puts targets on prefix rows
    lengths = torch.tensor([[s.length for s in row] + [0] * (batch.prefix_len.shape[1] - len(row))
                            for row in batch.segments])
    too_long = dataclasses.replace(batch, prefix_len=torch.minimum(batch.prefix_len + 1, lengths))
    assert not rows_blind_to_their_future(model, too_long)
    bidirectional = dataclasses.replace(batch, prefix_len=lengths)
    assert not rows_blind_to_their_future(model, bidirectional)
    labels = batch.labels.clone()
    labels[:, :-1] = torch.where(batch.segment_ids[:, 1:] == batch.segment_ids[:, :-1],
                                 batch.input_ids[:, 1:], IGNORE_INDEX)
    labels[batch.segment_ids == 0] = IGNORE_INDEX
    targets_on_prefix = dataclasses.replace(batch, labels=labels)
    assert not rows_blind_to_their_future(model, targets_on_prefix)


# ------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl,tol", [("segments", 1e-5), ("flex", 1e-4)])
def test_cuda_prefix_paths_equal_dense_forward_and_backward(impl, tol):
    """Rows over several 128-tiles (full tiles skip the mask_mod) with prefixes."""
    cuda = torch.device("cuda")
    batch = prefixed([[290], [40, 200, 30], [7, 260]], [[200], [40, 130, 0], [3, 129]], 300)
    outputs = {}
    for name in ("dense", impl):
        g = torch.Generator(device=cuda).manual_seed(0)
        q, k, v = (torch.randn(3, 2, 300, 16, generator=g, device=cuda).requires_grad_()
                   for _ in range(3))
        out = attend(q, k, v, prepare_visibility(batch.to(cuda), name, cuda, head_dim=16))
        out.square().sum().backward()
        outputs[name] = [out.detach(), q.grad, k.grad, v.grad]
    assert max_error(outputs[impl], outputs["dense"]) <= tol
