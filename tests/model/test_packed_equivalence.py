"""R3 acceptance (issue 3): packed rows == documents run one by one.

For the built-in decoder, a packed batch (several documents per row, positions reset,
padding at the tail) gives the same per-document logits, the same token-mean loss
and the same parameter gradients as running each document alone (fp32, 1e-5).
Negative control: a deliberately leaky visibility (one causal triangle over the
whole row, segments ignored) must fail the same check.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from equivalence import equivalence_error, equivalence_tolerance
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from model_batches import fill_rows, packed_batch

from exactstep.model.attention import Visibility
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import IGNORE_INDEX

VOCAB = 37
TOL = 1e-5  # R3: fp32, 1e-5 (``tolerance``: or fp32's own spread, were it larger)
DOC_LENGTHS = [[5, 9, 3], [12, 4], [1, 7]]  # three rows, last two padded
SEQ_LEN = 18


def tiny_config(attention: str) -> ModelConfig:
    return ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, attention=attention)


def leaky_visibility(batch) -> Visibility:
    """WRONG on purpose: every row is one causal triangle, documents see each other."""
    B, T = batch.shape
    mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, 1, T, T)
    return Visibility(impl="dense", batch_shape=(B, T), causal=True, dense_mask=mask)


def run_packed(model, documents, make_visibility=None, seq_len: int = SEQ_LEN):
    """Per-document logits, token-mean loss, gradients from one packed batch."""
    batch = packed_batch(documents, seq_len)
    model.zero_grad()
    vis = make_visibility(batch) if make_visibility else None
    logits = model.logits(model(batch, visibility=vis))  # [B, T, V]
    supervised = batch.labels != IGNORE_INDEX
    loss = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
    loss = loss / supervised.sum()
    loss.backward()
    per_doc = [
        logits[b, s.start : s.stop].detach() for b, row in enumerate(batch.segments) for s in row
    ]
    return per_doc, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_one_by_one(model, documents):
    """The same objective with each document alone in a batch of one unpadded row."""
    docs = [doc for row in documents for doc in row]
    total_targets = sum(len(doc) - 1 for doc in docs)
    model.zero_grad()
    per_doc, loss = [], torch.zeros(())
    for doc in docs:
        batch = packed_batch([[doc]], len(doc))
        logits = model.logits(model(batch))  # [1, n, V]
        supervised = batch.labels != IGNORE_INDEX
        part = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
        (part / total_targets).backward()  # gradients accumulate across documents
        per_doc.append(logits[0].detach())
        loss = loss + part.detach() / total_targets
    return per_doc, loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def tolerance(model, documents, separate) -> float:
    """R3's ``TOL``, or twice the one-by-one side's own distance from the same documents
    run in float64 (a copy of the model) where that is larger."""
    return equivalence_tolerance(TOL, separate, run_one_by_one(copy.deepcopy(model).double(),
                                                                documents))




@pytest.mark.parametrize("attention", ["segments", "dense"])
@pytest.mark.parametrize("tie", [True, False])
def test_packed_rows_equal_documents_one_by_one(attention, tie):
    cfg = ModelConfig(
        d_model=32, n_layers=2, n_heads=2, d_ff=48, attention=attention, tie_embeddings=tie
    )
    model = build_model(cfg, VOCAB, seed=3)
    documents = fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    packed = run_packed(model, documents)
    separate = run_one_by_one(model, documents)
    assert all(torch.isfinite(g).all() for g in packed[2].values())
    assert any(
        float(g.abs().max()) > 1e-4 for g in packed[2].values()
    )  # gradients are not trivially 0
    assert equivalence_error(packed, separate) <= tolerance(model, documents, separate)


def test_leaky_packing_fails_the_equivalence():
    # Negative control: the check must catch documents attending to each other.
    model = build_model(tiny_config("dense"), VOCAB, seed=3)
    documents = fill_rows(DOC_LENGTHS, VOCAB, seed=1)
    leaky = run_packed(model, documents, make_visibility=leaky_visibility)
    separate = run_one_by_one(model, documents)
    assert equivalence_error(leaky, separate) > 1e-3


@st.composite
def packings(draw):
    """1-3 rows of 1-4 documents (length 1-9 each), padded to the longest row."""
    rows = draw(
        st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3)
    )
    seq_len = max(sum(row) for row in rows) + draw(st.integers(0, 3))
    return rows, seq_len


@settings(max_examples=8, deadline=None)
@given(packings(), st.sampled_from(["segments", "dense"]), st.integers(0, 1000))
def test_random_packings_equal_documents_one_by_one(packing, attention, seed):
    lengths, seq_len = packing
    assume(sum(n - 1 for row in lengths for n in row) > 0)  # at least one target (else L4)
    model = build_model(tiny_config(attention), VOCAB, seed=seed)
    documents = fill_rows(lengths, VOCAB, seed=seed)
    packed = run_packed(model, documents, seq_len=seq_len)
    separate = run_one_by_one(model, documents)
    assert equivalence_error(packed, separate) <= tolerance(model, documents, separate)
