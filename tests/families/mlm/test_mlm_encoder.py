"""The built-in block stack as a bidirectional encoder on masked-LM rows (R2, R3, R8).

Packed = separate: a packed masked-LM batch (several pieces per row, padding) gives
each piece the same logits, the same token-mean loss and the same parameter
gradients as every piece compiled and run alone (fp32, 1e-5), under the
per-document SDPA path and the dense reference. Negative controls: a visibility
that lets the segments of a row see each other (bidirectional, segments ignored),
and the causal triangle on the same rows, both fail. Bidirectionality itself is
checked directly: a column's output moves when a *later* column of its segment
changes, and never when another segment changes.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from equivalence import equivalence_error, equivalence_tolerance
from mlm_support import alone, compile_rows, compiler, plan, random_examples

from exactstep.families.mlm.family import build_encoder
from exactstep.model.attention import Visibility, prepare_visibility
from exactstep.rows.batch import IGNORE_INDEX

VOCAB = 260
TOL = 1e-5  # R3: fp32, 1e-5
SEQ_LEN = 40


def encoder(attention: str, seed: int = 3):
    from exactstep.config import load_config

    cfg = load_config(None, ["objective.family=mlm", "model.d_model=32", "model.n_layers=2",
                             "model.n_heads=2", "model.d_ff=48", f"model.attention={attention}",
                             f"seed={seed}"])
    return build_encoder(cfg, VOCAB)


def leaky_visibility(batch) -> Visibility:
    """WRONG on purpose: every real column sees every real column of its row."""
    real = batch.segment_ids > 0
    mask = (real[:, :, None] & real[:, None, :]) | torch.eye(batch.shape[1], dtype=torch.bool)
    return Visibility(impl="dense", batch_shape=batch.shape, causal=False, dense_mask=mask[:, None])


def causal_visibility(batch) -> Visibility:
    """WRONG for an encoder: the same segments, but causal."""
    return prepare_visibility(dataclasses.replace(batch, causal=True), "dense", "cpu")


def rows_and_examples():
    examples = random_examples(9, seed=2, lo=3, hi=30)
    rows = plan(examples, SEQ_LEN, 4)
    assert any(len(row) > 1 for row in rows)  # packing happened
    assert any(sum(p.length for p in row) < SEQ_LEN for row in rows)  # and padding
    return examples, rows


def run_packed(model, make_visibility=None):
    examples, rows = rows_and_examples()
    batch = compile_rows(compiler(5), rows, examples, SEQ_LEN)
    model.zero_grad()
    vis = make_visibility(batch) if make_visibility else None
    logits = model.logits(model(batch, visibility=vis))  # [B, T, V]
    supervised = batch.labels != IGNORE_INDEX
    loss = F.cross_entropy(logits[supervised], batch.labels[supervised], reduction="sum")
    loss = loss / supervised.sum()
    loss.backward()
    per_piece = [logits[b, s.start : s.stop].detach()
                 for b, row in enumerate(batch.segments) for s in row]
    return per_piece, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def run_one_by_one(model):
    """Each piece compiled alone (its addressed mask is the same) and run alone."""
    examples, rows = rows_and_examples()
    singles = [alone(compiler(5), piece, examples) for row in rows for piece in row]
    total = sum(int((b.labels != IGNORE_INDEX).sum()) for b in singles)
    model.zero_grad()
    per_piece, loss = [], torch.zeros(())
    for batch in singles:
        n = batch.segments[0][0].length
        logits = model.logits(model(batch))[0, :n]  # [n, V]
        supervised = batch.labels[0, :n] != IGNORE_INDEX
        part = F.cross_entropy(logits[supervised], batch.labels[0, :n][supervised],
                               reduction="sum")
        (part / total).backward()
        per_piece.append(logits.detach())
        loss = loss + part.detach() / total
    return per_piece, loss, {n: p.grad.clone() for n, p in model.named_parameters()}




@pytest.mark.parametrize("attention", ["segments", "dense"])
def test_packed_masked_rows_equal_pieces_run_alone(attention):
    model = encoder(attention)
    packed = run_packed(model)
    assert any(float(g.abs().max()) > 1e-4 for g in packed[2].values())  # not trivially 0
    separate = run_one_by_one(model)
    # R3's TOL, or twice the pieces' own fp32 distance from float64 where that is larger
    assert equivalence_error(packed, separate) <= equivalence_tolerance(
        TOL, separate, run_one_by_one(copy.deepcopy(model).double()))


@pytest.mark.parametrize("wrong", [leaky_visibility, causal_visibility])
def test_leaky_or_causal_visibility_fails_the_equivalence(wrong):
    model = encoder("dense")
    assert equivalence_error(run_packed(model, wrong), run_one_by_one(model)) > 1e-3


@pytest.mark.parametrize("attention", ["segments", "dense"])
def test_a_column_sees_later_columns_of_its_segment_and_nothing_else(attention):
    examples, rows = rows_and_examples()
    batch = compile_rows(compiler(5), rows, examples, SEQ_LEN)
    model = encoder(attention).eval()
    b = next(i for i, row in enumerate(batch.segments) if len(row) > 1)
    first, second = batch.segments[b][0], batch.segments[b][1]
    with torch.no_grad():
        before = model(batch)
        later = batch.input_ids.clone()
        later[b, first.stop - 1] = (int(later[b, first.stop - 1]) + 1) % 256
        after = model(dataclasses.replace(batch, input_ids=later))
        causal = dataclasses.replace(batch, causal=True)
        causal_after = model(dataclasses.replace(causal, input_ids=later))
        causal_before = model(causal)
    # the first column of the segment sees its last one (bidirectional) ...
    assert not torch.allclose(before[b, first.start], after[b, first.start])
    # ... which a causal batch would not; and the neighbouring segment sees nothing of it
    torch.testing.assert_close(causal_before[b, first.start], causal_after[b, first.start],
                               rtol=0, atol=0)
    torch.testing.assert_close(before[b, second.start : second.stop],
                               after[b, second.start : second.stop], rtol=0, atol=0)

