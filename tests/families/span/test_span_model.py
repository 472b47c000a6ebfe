"""Span-corruption rows on the built-in encoder-decoder (R3, R8, U1).

- Packed = separate: a row packing several corrupted pieces gives, for each piece,
  the decoder hidden states, and in sum the loss and every gradient, of that piece
  compiled alone into an unpadded row (fp32, 1e-5). The piece alone is corrupted the
  same way (its draws are addressed by its identity), so the comparison is exact in
  meaning. Negative controls: a leaky compiler (one encoder segment per row, so the
  encoder mixes the pieces) and a leaky cross-attention mask (decoder segments see
  every source of their row) must fail the same check.
- U1: a window of three span microbatches makes the same update as one microbatch
  holding all their rows (SGD, 1e-5); a plan that averages each microbatch on its
  own (mean of means) does not.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from equivalence import spread_bound, sum_bound
from families.corruption_support import corpus, trimmed

import exactstep.model.encdec as encdec
from exactstep.config import load_config
from exactstep.families.span.compiler import SpanCompiler
from exactstep.families.span.config import SpanConfig
from exactstep.model.encdec import build_encoder_decoder
from exactstep.objective import plan_window
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, SourceSide
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

BOS, EOS, PAD = 256, 257, 258
SENTINELS = 8
VOCAB = 259 + SENTINELS
SPAN = SpanConfig(sentinels=SENTINELS)
CFG = BatchConfig(seq_len=64, rows=2, buffer=8)
TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
        "seed=3"]


def compiler() -> SpanCompiler:
    return SpanCompiler(SPAN, seed=3, bos_id=BOS, eos_id=EOS,
                        sentinel_ids=[VOCAB - 1 - k for k in range(SENTINELS)])


def examples(lengths) -> list[Example]:
    return corpus(lengths, seed=1)


def model(attention: str = "auto"):
    return build_encoder_decoder(load_config(None, TINY + [f"model.attention={attention}"]),
                                 VOCAB)


def loss_and_grads(m, batch: Batch):
    m.zero_grad()
    logits = m.logits(m(batch))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch.labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


EXAMPLES = examples([9, 14, 6, 20, 11, 4])
ROWS = [[Piece(0, 0, 11, 0), Piece(1, 0, 16, 0), Piece(2, 0, 8, 0)],
        [Piece(3, 0, 22, 0), Piece(4, 0, 13, 0), Piece(5, 0, 6, 0)]]


#: R3's 1e-5 (fp32) on the hidden states (O(1) after the final norm; fp32 rounds them
#: to ~1e-7, as the float64 runs below measure)
TOL = 1e-5


def alone_sums(m, c: SpanCompiler, rows):
    """The loss sum and gradient sums over each piece run alone."""
    loss_a, grad_a = 0.0, None
    for row in rows:
        for piece in row:
            alone = trimmed(c.compile([[piece]], EXAMPLES, CFG, pad_id=PAD, weighted=False))
            loss, grad = loss_and_grads(m, alone)
            loss_a = loss_a + loss
            grad_a = grad if grad_a is None else {k: grad_a[k] + grad[k] for k in grad}
    return loss_a, grad_a


def packed_equals_separate(m, c: SpanCompiler, rows=ROWS) -> None:
    """The hidden states of each piece within ``TOL``; the loss sum and every gradient
    sum over the ``n`` (~80) targets within ``n TOL`` (R3's 1e-5 on the token mean, as
    ``tests/equivalence.py`` holds it: a loss sum of ~440 has an ulp of 3e-5), or twice
    the alone sums' own distance from float64 where that is larger (``spread_bound``),
    plus for the loss the worst case of its two summation orders (``2 sum_bound``)."""
    packed = c.compile(rows, EXAMPLES, CFG, pad_id=PAD, weighted=False)
    assert all(len(s) == 3 for s in packed.segments)
    loss_p, grad_p = loss_and_grads(m, packed)
    hidden = m(packed).detach()
    for b, row in enumerate(rows):
        for seg, piece in zip(packed.segments[b], row, strict=True):
            alone = trimmed(c.compile([[piece]], EXAMPLES, CFG, pad_id=PAD, weighted=False))
            torch.testing.assert_close(hidden[b, seg.start:seg.stop], m(alone).detach()[0],
                                       rtol=0, atol=TOL)
    loss_a, grad_a = alone_sums(m, c, rows)
    loss_x, grad_x = alone_sums(copy.deepcopy(m).double(), c, rows)
    with torch.no_grad():
        terms = F.cross_entropy(m.logits(hidden).float().reshape(-1, VOCAB),
                                packed.labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                reduction="none")
    n = int((packed.labels != IGNORE_INDEX).sum())
    assert abs(float(loss_p - loss_a)) <= max(n * TOL, spread_bound(loss_a, loss_x)) + (
        2 * sum_bound(terms))
    for name in grad_p:
        assert float((grad_p[name] - grad_a[name]).abs().max()) <= max(
            n * TOL, spread_bound(grad_a[name], grad_x[name])), name


@pytest.mark.parametrize("attention", ["auto", "dense"])
def test_packed_span_rows_equal_each_piece_alone(attention):
    packed_equals_separate(model(attention), compiler())


class OneEncoderSegment(SpanCompiler):
    """Leaky: the encoder side gives every real column of a row segment id 1."""

    def compile(self, rows, examples, cfg, *, pad_id, weighted):
        batch = super().compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
        src = batch.source
        ids = torch.where(src.segment_ids > 0, 1, 0).to(src.segment_ids.dtype)
        return replace(batch, source=replace(src, segment_ids=ids))


def test_a_leaky_compiler_fails_packed_equals_separate():
    leaky = OneEncoderSegment(SPAN, seed=3, bos_id=BOS, eos_id=EOS,
                              sentinel_ids=[VOCAB - 1 - k for k in range(SENTINELS)])
    with pytest.raises(AssertionError):
        packed_equals_separate(model("dense"), leaky)


def test_a_leaky_cross_attention_fails_packed_equals_separate(monkeypatch):
    def leaky(dec, src):  # every decoder query sees every real source column of its row
        return ((dec[:, :, None] != 0) & (src[:, None, :] != 0))[:, None]

    monkeypatch.setattr(encdec, "dense_cross_mask", leaky)
    with pytest.raises(AssertionError):
        packed_equals_separate(model("dense"), compiler())


# --------------------------------------------------------------------------- U1


def concat(batches: list[Batch]) -> Batch:
    def cat(name, side=None):
        return torch.cat([getattr(b if side is None else b.source, name) for b in batches])

    source = SourceSide(cat("input_ids", 1), cat("position_ids", 1), cat("segment_ids", 1),
                        tuple(s for b in batches for s in b.source.segments))
    return Batch(cat("input_ids"), cat("labels"), cat("position_ids"), cat("segment_ids"),
                 tuple(s for b in batches for s in b.segments), source=source)


def one_update(batches: list[Batch], *, mean_of_means: bool = False) -> list[torch.Tensor]:
    m = model()
    cfg = UpdateConfig(optimizer="sgd", lr=1.0, momentum=0.0, clip=0.0, weight_decay=0.0,
                       schedule="constant", warmup=0, accum=len(batches))
    optimizer, _ = build_optimizer(m, cfg)
    engine = UpdateEngine(m, optimizer, build_schedule(cfg, 10),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=8), device="cpu", pad_id=PAD)
    if mean_of_means:
        def wrong_plan(bs, objective, **kw):  # each microbatch's own mean, divided by K
            plan = plan_window(bs, objective, **kw)
            k = len(bs)
            coeffs = [c / max(1.0, float(c.sum())) / k for c in plan.coefficients]
            return type(plan)(coeffs, 1.0, plan.tokens, [1.0] * k, plan.row_indices,
                              plan.microbatch_tokens)

        engine.plan = wrong_plan
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def matches_big_batch(*, mean_of_means: bool) -> bool:
    stream = RowStream(examples([10, 5, 33, 12, 25, 8, 21, 3, 17, 40, 6, 9, 70]), CFG, pad_id=PAD, seed=3,
                       vocab_size=VOCAB, compiler=compiler())
    batches = [stream.next_batch() for _ in range(3)]
    assert len({b.num_targets() for b in batches}) > 1  # unequal microbatches
    split = one_update(batches, mean_of_means=mean_of_means)
    whole = one_update([concat(batches)])
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    return max(float((a - b).abs().max()) for a, b in zip(split, whole, strict=True)) <= 1e-5


def test_span_accumulation_equals_the_big_batch_u1():
    assert matches_big_batch(mean_of_means=False)


def test_span_mean_of_means_is_caught_u1():
    assert not matches_big_batch(mean_of_means=True)
