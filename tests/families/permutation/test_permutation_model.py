"""The two-stream permutation-LM model (R8, R2, R3, U1) against independent expectations.

- Masks: ``stream_masks`` equals the pure-Python oracle's two streams exactly.
- The defining observation: changing the token at column ``j`` changes the query
  stream's output at column ``i`` exactly when ``j`` ranks before ``i`` in ``i``'s
  segment (the oracle's ``query_depends_on``); in particular the output at a
  predicted column never moves with its own token. Negative controls: a query stream
  that sees its own content, and a one-stream model over tokens physically shuffled
  into the order, fail it; a shuffled one-stream model that reads the previous slot
  passes it but cannot tell which position it predicts, which the two streams can.
- Packed rows equal their documents alone (1e-5, loss and gradients); leaky masks fail.
- Under the identity order the content stream is the causal decoder with the same
  weights (1e-5), and the query stream is a causal predictor of token ``i`` from the
  tokens before it.
- Exact accumulation (U1) through the real update engine.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from equivalence import equivalence_error, equivalence_tolerance

from exactstep.errors import ModelError
from exactstep.families.permutation.compiler import PermutationCompiler
from exactstep.families.permutation.reference import query_depends_on
from exactstep.families.permutation.reference import stream_masks as ref_masks
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.model.permutation import (
    TwoStreamDecoder,
    build_two_stream,
    masks_from,
    stream_masks,
    visibility,
)
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece

VOCAB, PAD, BOS, EOS = 40, 0, 38, 39
#: R3 / U1 (fp32): O(1) logits and gradients of a 2-layer d=32 model round to ~1e-7;
#: packed = separate also takes twice fp32's own spread from float64 if larger
TOL = 1e-5
# init_std 0.2: attention far from uniform at init, so positions and contents matter
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=48, init_std=0.2)


def model(seed: int = 3, **kw) -> TwoStreamDecoder:
    return build_two_stream(replace(CFG, **kw), VOCAB, seed=seed)


def examples(lengths, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [Example(i, np.array([BOS, *rng.integers(1, 38, n - 2), EOS])) for i, n in
            enumerate(lengths)]


def compile_rows(rows, exs, seq_len, k=1, seed=5) -> Batch:
    cfg = BatchConfig(seq_len=seq_len, rows=len(rows))
    compiler = PermutationCompiler(seed=seed, predict_one_in=k)
    batch = compiler.compile(rows, exs, cfg, pad_id=PAD, weighted=False)
    compiler.check(batch, VOCAB, cfg)
    return batch


def two_segment_row(k: int = 1) -> Batch:
    """One row: a document of 6 tokens, one of 5, two padding columns."""
    exs = examples([6, 5])
    return compile_rows([[Piece(0, 0, 6, 0), Piece(1, 0, 5, 0)]], exs, 13, k=k)


def test_stream_masks_equal_the_oracle_and_empty_rows_attend_to_nothing():
    batch = compile_rows([[Piece(0, 0, 6, 0), Piece(1, 0, 5, 0)], [Piece(2, 0, 4, 0)]],
                         examples([6, 5, 4]), 13)
    masks = stream_masks(batch, "cpu")
    T = 13
    for b in range(2):
        content, query = ref_masks(batch.segment_ids[b].tolist(), batch.order[b].tolist())
        live = [any(row) for row in content + query]
        assert masks.live[b, :, 0].tolist() == live
        # a row that sees nothing has only its own column switched on (output zeroed)
        expected = [row if any(row) else [c == i % T for c in range(T)]
                    for i, row in enumerate(content + query)]
        assert masks.mask[b, 0].tolist() == expected
    assert not masks.live[0, T + 0, 0]  # the BOS (rank 0) query row sees nothing
    with pytest.raises(ModelError, match="needs Batch.order"):
        model()(replace(batch, order=None))


def test_the_decoder_weights_are_the_built_in_decoder_s():
    two = model(seed=11).state_dict()
    one = build_model(CFG, VOCAB, seed=11).state_dict()
    assert set(two) - set(one) == {"query"}
    assert all(torch.equal(two[name], one[name]) for name in one)


# --------------------------------------------------------------------------- the defining test


def perturbed(batch: Batch, col: int) -> Batch:
    ids = batch.input_ids.clone()
    ids[0, col] = 1 + (int(ids[0, col]) + 6) % 37  # another real token
    return replace(batch, input_ids=ids)


def dependency_errors(forward, batch: Batch) -> list[str]:
    """Where ``forward``'s outputs move differently from the oracle when each real
    column's token is changed in turn: ``[]`` when exactly the columns ranked after
    the changed one (same segment) move, bitwise-unchanged everywhere else."""
    base = forward(batch)
    segs, order = batch.segment_ids[0].tolist(), batch.order[0].tolist()
    errors = []
    for j in range(len(segs)):
        if segs[j] == 0:
            continue
        out = forward(perturbed(batch, j))
        for i in range(len(segs)):
            moved = not torch.equal(out[0, i], base[0, i])
            allowed = j in query_depends_on(segs, order, i)
            if moved != allowed:
                errors.append(f"token {j} {'moved' if moved else 'did not move'} output {i}")
    return errors


def test_changing_a_token_moves_exactly_the_outputs_ranked_after_it():
    net = model()
    for k in (1, 2):
        with torch.no_grad():
            assert dependency_errors(net, two_segment_row(k)) == []


def test_negative_control_a_query_stream_that_sees_its_own_content_fails():
    net = model()

    def own_content(batch):
        content, _ = visibility(batch.segment_ids, batch.order)
        return net(batch, masks_from(content, content))

    with torch.no_grad():
        errors = dependency_errors(own_content, two_segment_row())
    assert any("moved output" in e for e in errors)


class EmbeddingQuery(TwoStreamDecoder):
    """WRONG on purpose: the query stream starts from the token embedding of its column."""

    def query_start(self, content):
        return content


def test_negative_control_a_query_stream_started_from_the_token_embedding_fails():
    net = EmbeddingQuery(CFG, VOCAB, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        errors = dependency_errors(net, two_segment_row())
    assert any("moved output" in e for e in errors)


def shuffled_one_stream(decoder, batch: Batch, *, read_previous: bool) -> torch.Tensor:
    """WRONG on purpose: move each segment's tokens (with their natural positions) into
    factorisation order and run the causal decoder; the output for column ``z_t`` is
    the hidden state of slot ``t`` (its own token) or, with ``read_previous``, of slot
    ``t - 1`` (the slot before it; zero for the first)."""
    out = torch.zeros(*batch.shape, decoder.cfg.d_model)
    for b, segments in enumerate(batch.segments):
        for seg in segments:
            cols = torch.arange(seg.start, seg.stop)
            z = cols[torch.argsort(batch.order[b, seg.start : seg.stop])]
            alone = Batch(batch.input_ids[b, z][None], torch.full((1, seg.length), IGNORE_INDEX),
                          batch.position_ids[b, z][None], torch.ones(1, seg.length, dtype=torch.int32),
                          ((Segment(seg.example_id, seg.piece, 0, 0, seg.length),),))
            hidden = decoder(alone)[0]  # [L, H]
            if read_previous:
                out[b, z[1:]] = hidden[:-1]
            else:
                out[b, z] = hidden
    return out


def test_negative_control_shuffling_the_tokens_fails():
    decoder = build_model(CFG, VOCAB, seed=3)
    with torch.no_grad():
        errors = dependency_errors(
            lambda b: shuffled_one_stream(decoder, b, read_previous=False), two_segment_row())
    assert any("moved output" in e for e in errors)


def same_context_other_target(forward) -> float:
    """The same factorisation context (columns 0, 1, 2, 3 first, in that order) followed
    by the target at column 5 (order A) or at column 8 (order B): how far apart are the
    two predictions? A model that knows which position it predicts gives two different
    ones; a single stream over shuffled tokens cannot (its state is the context's)."""
    tokens = [BOS, 7, 12, 3, 25, 9, 31, 4, 16, 22, EOS]
    n = len(tokens)
    rest_a = [c for c in range(4, n) if c != 5]
    rest_b = [c for c in range(4, n) if c != 8]
    outputs = []
    for target, rest in ((5, rest_a), (8, rest_b)):
        z = [0, 1, 2, 3, target, *rest]
        order = torch.tensor([[z.index(c) for c in range(n)]])
        batch = Batch(torch.tensor([tokens]), torch.full((1, n), IGNORE_INDEX),
                      torch.arange(n)[None], torch.ones(1, n, dtype=torch.int32),
                      ((Segment(0, 0, 0, 0, n),),), order=order)
        outputs.append(forward(batch)[0, target])
    return float((outputs[0] - outputs[1]).abs().max())


def test_the_query_stream_knows_which_position_it_predicts():
    with torch.no_grad():
        assert same_context_other_target(model()) > 1e-3


def test_negative_control_a_shuffled_stream_reading_the_previous_slot_hides_content_but_not_where():
    decoder = build_model(CFG, VOCAB, seed=3)
    with torch.no_grad():
        def forward(b):
            return shuffled_one_stream(decoder, b, read_previous=True)
        assert dependency_errors(forward, two_segment_row()) == []  # passes the first test
        assert not same_context_other_target(forward) > 1e-3  # but not this one


# --------------------------------------------------------------------------- packed == separate


ROW_LENGTHS = [[7, 5, 3], [9, 4], [6]]
SEQ_LEN = 16


def packed_rows(k: int):
    exs, rows, i = [], [], 0
    for lengths in ROW_LENGTHS:
        row = []
        for n in lengths:
            row.append(Piece(i, 0, n, 0, epoch=1))
            i += 1
        rows.append(row)
    exs = examples([n for lengths in ROW_LENGTHS for n in lengths], seed=2)
    return exs, rows


def loss_and_grads(net, batches, total: int, masks=None):
    """Per-document predicted logits, the token-mean loss over ``total`` targets and the
    gradients, summed over ``batches``."""
    net.zero_grad()
    per_doc, loss = [], torch.zeros(())
    for batch in batches:
        hidden = net(batch, masks(batch) if masks else None)
        logits = net.logits(hidden)
        owned = batch.labels != IGNORE_INDEX
        part = F.cross_entropy(logits[owned], batch.labels[owned], reduction="sum") / total
        part.backward()
        loss = loss + part.detach()
        per_doc += [logits[b, s.start : s.stop][owned[b, s.start : s.stop]].detach()
                    for b, row in enumerate(batch.segments) for s in row]
    return per_doc, loss, {n: p.grad.clone() for n, p in net.named_parameters()}




def leaky(batch):
    """WRONG on purpose: the rank rules over the whole row, segments ignored."""
    real = batch.segment_ids > 0
    pair = real[:, :, None] & real[:, None, :]
    ri, rj = batch.order[:, :, None], batch.order[:, None, :]
    eye = torch.eye(batch.shape[1], dtype=torch.bool)
    return masks_from((pair & (rj <= ri)) | (eye & ~real[:, :, None]), pair & (rj < ri))


def packed_and_separate(k: int, masks=None):
    """The packed side, the separate side, and ``TOL`` or twice the separate side's own
    distance from the same documents in float64 where that is larger."""
    net = model(seed=4, tie_embeddings=False)
    exs, rows = packed_rows(k)
    packed = compile_rows(rows, exs, SEQ_LEN, k=k)
    total = packed.num_targets()
    alone = [compile_rows([[p]], exs, p.length, k=k) for row in rows for p in row]
    assert sum(b.num_targets() for b in alone) == total  # the same draws, alone or packed
    separate = loss_and_grads(net, alone, total)
    exact = loss_and_grads(copy.deepcopy(net).double(), alone, total)
    return (loss_and_grads(net, [packed], total, masks), separate,
            equivalence_tolerance(TOL, separate, exact))


@pytest.mark.parametrize("k", [1, 3])
def test_packed_rows_equal_documents_one_by_one(k):
    packed, separate, tol = packed_and_separate(k)
    assert any(float(g.abs().max()) > 1e-4 for g in packed[2].values())  # not trivially 0
    assert packed[2]["query"].abs().max() > 0  # the query vector is trained
    assert equivalence_error(packed, separate) <= tol


def test_negative_control_leaky_masks_fail_the_equivalence():
    packed, separate, tol = packed_and_separate(1, masks=leaky)
    assert equivalence_error(packed, separate) > max(1e-3, tol)


# --------------------------------------------------------------------------- the identity order


def identity_batch(rows_of_docs: list[list[list[int]]], seq_len: int) -> Batch:
    """Documents packed left to right with the natural order as factorisation order and
    every token but the first predicted (the causal LM's targets, unshifted)."""
    B = len(rows_of_docs)
    ids = torch.full((B, seq_len), PAD)
    labels = torch.full((B, seq_len), IGNORE_INDEX)
    pos = torch.zeros((B, seq_len), dtype=torch.long)
    seg = torch.zeros((B, seq_len), dtype=torch.int32)
    segments = []
    for b, docs in enumerate(rows_of_docs):
        col, row = 0, []
        for s, doc in enumerate(docs, start=1):
            n = len(doc)
            ids[b, col : col + n] = torch.tensor(doc)
            labels[b, col + 1 : col + n] = torch.tensor(doc[1:])
            pos[b, col : col + n] = torch.arange(n)
            seg[b, col : col + n] = s
            row.append(Segment(len(segments) * 10 + s, 0, 0, col, n))
            col += n
        segments.append(tuple(row))
    return Batch(ids, labels, pos, seg, tuple(segments), order=pos.clone())


DOCS = [[[BOS, 5, 9, 2, 30, EOS], [BOS, 7, 7, EOS]], [[BOS, 11, 3, 19, 23, 8, 1, EOS]]]


def test_under_the_identity_order_the_content_stream_is_the_causal_decoder():
    net = model(seed=6)
    decoder = build_model(replace(CFG, attention="dense"), VOCAB, seed=6)
    batch = identity_batch(DOCS, 10)
    with torch.no_grad():
        content, _ = net.streams(batch)
        causal = decoder(batch)
        real = batch.segment_ids > 0
        assert float((content - causal)[real].abs().max()) <= TOL

        # negative control: a content stream that does not see its own token
        _, query = visibility(batch.segment_ids, batch.order)
        blind, _ = net.streams(batch, masks_from(query, query))
        assert float((blind - causal)[real].abs().max()) > 1e-3


def test_under_the_identity_order_the_query_stream_predicts_token_i_from_tokens_before_i():
    """The causal LM's dependency structure: output ``i`` moves with token ``j`` iff
    ``j < i`` in its document (exactly the shifted causal row ``i - 1``'s support)."""
    net = model(seed=6)
    batch = identity_batch([DOCS[1]], 8)
    with torch.no_grad():
        base = net(batch)
        for j in range(8):
            out = net(perturbed(batch, j))
            moved = [not torch.equal(out[0, i], base[0, i]) for i in range(8)]
            assert moved == [i > j for i in range(8)], j


# --------------------------------------------------------------------------- U1


def one_update(batches: list[Batch], *, mean_of_means: bool = False) -> list[torch.Tensor]:
    from exactstep.objective import plan_window
    from exactstep.objective.config import ObjectiveConfig
    from exactstep.update.config import NumericsConfig, UpdateConfig
    from exactstep.update.disposition import Outcome
    from exactstep.update.groups import build_optimizer
    from exactstep.update.precision import Precision
    from exactstep.update.schedule import build_schedule
    from exactstep.update.window import UpdateEngine

    net = model(seed=8)
    cfg = UpdateConfig(optimizer="sgd", lr=1.0, momentum=0.0, clip=0.0, weight_decay=0.0,
                       schedule="constant", warmup=0, accum=len(batches))
    optimizer, _ = build_optimizer(net, cfg)
    engine = UpdateEngine(net, optimizer, build_schedule(cfg, 10),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=8), device="cpu", pad_id=PAD)
    if mean_of_means:
        def wrong_plan(bs, objective_cfg):  # each microbatch's own mean, divided by K
            plan = plan_window(bs, objective_cfg)
            n = len(bs)
            coeffs = [c / max(1.0, float(c.sum())) / n for c in plan.coefficients]
            return type(plan)(coeffs, 1.0, plan.tokens, [1.0] * n, plan.row_indices,
                              plan.microbatch_tokens)
        engine.plan = wrong_plan
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def concatenated(batches: list[Batch]) -> Batch:
    def cat(name):
        return torch.cat([getattr(b, name) for b in batches])
    return Batch(cat("input_ids"), cat("labels"), cat("position_ids"), cat("segment_ids"),
                 tuple(s for b in batches for s in b.segments), order=cat("order"))


def accumulation_error(mean_of_means: bool) -> float:
    exs, rows = packed_rows(2)
    micro = [compile_rows([row], exs, SEQ_LEN, k=2) for row in rows]  # 3 microbatches
    split = one_update(micro, mean_of_means=mean_of_means)
    whole = one_update([concatenated(micro)])
    return max(float((a - b).abs().max()) for a, b in zip(split, whole, strict=True))


def test_accumulated_microbatches_equal_one_batch_u1():
    assert accumulation_error(mean_of_means=False) <= TOL


def test_negative_control_mean_of_means_is_caught_u1():
    assert accumulation_error(mean_of_means=True) > TOL
