"""The built-in encoder-decoder (R8): structural cross-attention visibility.

Batches here are built by hand from (source, target) token lists, independently of
the rows compiler: decoder input ``tgt[:-1]``, labels ``tgt[1:]``, both sides packed
left to right with segment ids 1, 2, ... and padding 0.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from equivalence import spread_bound, sum_bound

import exactstep.model.encdec as encdec
from exactstep.errors import ModelError
from exactstep.model.config import ModelConfig
from exactstep.model.encdec import EncoderDecoder, build_encoder_decoder
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, SourceSide

V = 23
CFG = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)

#: R3's 1e-5 (fp32): hidden states are O(1) after the final norm, fp32 rounds them to
#: ~1e-7 (the test's own float64 runs measure it), two orders below
TOL = 1e-5


def tolerance(value: torch.Tensor, exact: torch.Tensor, batch: Batch, terms=None) -> float:
    """For a loss sum or its gradients over the batch's ``n`` targets (~30): ``n TOL``
    (R3's 1e-5 on the token mean, as ``tests/equivalence.py`` holds it: a loss sum of
    ~80 has an ulp of 7.6e-6), or twice the fp32 value's own distance from float64 where
    that is larger (``spread_bound``); for the loss, plus the worst case of two summation
    orders of its ``terms`` (``2 sum_bound``)."""
    n = int((batch.labels != IGNORE_INDEX).sum())
    order = 0.0 if terms is None else 2 * sum_bound(terms)
    return max(n * TOL, spread_bound(value, exact)) + order


def token_losses(m, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = m.logits(m(batch)).float()
        return F.cross_entropy(logits.reshape(-1, V), batch.labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="none")


def side(rows, width, pad, *, shift):
    """Packed tensors of one side: ``rows[b]`` lists token lists; with ``shift`` the
    inputs are ``seq[:-1]`` and the labels ``seq[1:]``."""
    B = len(rows)
    ids = torch.full((B, width), pad, dtype=torch.long)
    labels = torch.full((B, width), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros((B, width), dtype=torch.long)
    seg = torch.zeros((B, width), dtype=torch.int32)
    segments = []
    example = 0
    for b, seqs in enumerate(rows):
        col, row = 0, []
        for k, seq in enumerate(seqs):
            inputs = seq[:-1] if shift else seq
            n = len(inputs)
            ids[b, col:col + n] = torch.tensor(inputs)
            if shift:
                labels[b, col:col + n] = torch.tensor(seq[1:])
            pos[b, col:col + n] = torch.arange(n)
            seg[b, col:col + n] = k + 1
            row.append(Segment(example, 0, 0, col, n))
            example += 1
            col += n
        segments.append(tuple(row))
    return ids, labels, pos, seg, tuple(segments)


def pair_batch(rows, T, S, *, pad=0, source_pad=None):
    """``rows[b]`` lists the (source, target) pairs of row b."""
    s_ids, _, s_pos, s_seg, s_segments = side([[p[0] for p in r] for r in rows], S,
                                              pad if source_pad is None else source_pad,
                                              shift=False)
    ids, labels, pos, seg, segments = side([[p[1] for p in r] for r in rows], T, pad, shift=True)
    return Batch(ids, labels, pos, seg, segments,
                 source=SourceSide(s_ids, s_pos, s_seg, s_segments))


def random_pairs(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ls, lt = (int(x) for x in torch.randint(2, 9, (2,), generator=g))
        out.append((torch.randint(1, V, (ls,), generator=g).tolist(),
                    torch.randint(1, V, (lt,), generator=g).tolist()))
    return out


def model(cross="pairs", **kw):
    return EncoderDecoder(CFG, V, generator=torch.Generator().manual_seed(7),
                          cross_attention=cross, **kw)


def loss_sum(m, batch):
    logits = m.logits(m(batch))
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays
    return F.cross_entropy(logits.reshape(-1, V), batch.labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def grads(m, batch):
    m.zero_grad()
    loss = loss_sum(m, batch)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


PAIRS = random_pairs(5, 0)
PACKED = [[PAIRS[0], PAIRS[1], PAIRS[2]], [PAIRS[3], PAIRS[4]]]


@pytest.mark.parametrize("buckets", ["chosen", "one_per_length"])
def test_pairs_path_equals_the_dense_reference_forward_and_backward(buckets, monkeypatch):
    if buckets == "one_per_length":  # several buckets of different (Lq, Lk)
        monkeypatch.setattr(encdec, "choose_buckets", lambda lengths: sorted(set(lengths)))
    batch = pair_batch(PACKED, 28, 30)
    dense, fast = model("dense"), model("pairs")
    torch.testing.assert_close(fast(batch), dense(batch), rtol=0, atol=TOL)
    (l_d, g_d), (l_f, g_f) = grads(dense, batch), grads(fast, batch)
    l_x, g_x = grads(copy.deepcopy(dense).double(), batch)  # the yardstick: dense in float64
    assert abs(float(l_f - l_d)) <= tolerance(l_d, l_x, batch, token_losses(dense, batch))
    for name in g_d:
        assert float((g_f[name] - g_d[name]).abs().max()) <= tolerance(g_d[name], g_x[name],
                                                                      batch), name


def alone_sums(m, rows):
    """The loss sum and gradient sums over each pair run alone in an unpadded row."""
    alone_loss, alone_grad = 0.0, None
    for row in rows:
        for pair in row:
            single = pair_batch([[pair]], len(pair[1]) - 1, len(pair[0]))
            loss, grad = grads(m, single)
            alone_loss = alone_loss + loss
            alone_grad = grad if alone_grad is None else {
                k: alone_grad[k] + grad[k] for k in grad}
    return alone_loss, alone_grad


def packed_equals_separate(m, rows, T, S):
    """Loss sum and every gradient of the packed batch equal the sums over each pair
    run alone in an unpadded row (``tolerance``); the decoder hidden of each pair too
    (``TOL``)."""
    packed = pair_batch(rows, T, S)
    loss_p, grad_p = grads(m, packed)
    hidden = m(packed).detach()
    for b, row in enumerate(rows):
        for seg, pair in zip(packed.segments[b], row, strict=True):
            single = pair_batch([[pair]], len(pair[1]) - 1, len(pair[0]))
            torch.testing.assert_close(hidden[b, seg.start:seg.stop], m(single).detach()[0],
                                       rtol=0, atol=TOL)
    alone_loss, alone_grad = alone_sums(m, rows)
    exact_loss, exact_grad = alone_sums(copy.deepcopy(m).double(), rows)
    assert abs(float(loss_p - alone_loss)) <= tolerance(alone_loss, exact_loss, packed,
                                                         token_losses(m, packed))
    for name in grad_p:
        assert float((grad_p[name] - alone_grad[name]).abs().max()) <= tolerance(
            alone_grad[name], exact_grad[name], packed), name


@pytest.mark.parametrize("cross", ["dense", "pairs"])
def test_packed_equals_separate(cross):
    packed_equals_separate(model(cross), PACKED, 28, 30)


def test_leaky_cross_attention_fails_packed_equals_separate(monkeypatch):
    """Negative control: decoder segments that also see the other segments' sources
    of their row (the same check on a leaky mask must fail)."""
    def leaky(dec, src):
        return ((dec[:, :, None] != 0) & (src[:, None, :] != 0))[:, None]

    monkeypatch.setattr(encdec, "dense_cross_mask", leaky)
    with pytest.raises(AssertionError):
        packed_equals_separate(model("dense"), PACKED, 28, 30)


def test_source_padding_and_its_pad_id_change_nothing():
    m = model("pairs")
    a = pair_batch(PACKED, 28, 30, source_pad=0)
    b = pair_batch(PACKED, 28, 30, source_pad=V - 1)
    torch.testing.assert_close(m(a), m(b), rtol=0, atol=0)


def test_mismatched_pairing_is_refused():
    batch = pair_batch(PACKED, 28, 30)
    wrong = batch.source.segments[0][:2]
    source = SourceSide(batch.source.input_ids, batch.source.position_ids,
                        batch.source.segment_ids, (wrong, batch.source.segments[1]))
    with pytest.raises(ModelError, match="row 0: 3 decoder segments but 2 encoder"):
        model()(replace(batch, source=source))
    with pytest.raises(ModelError, match="needs batch.source"):
        model()(replace(batch, source=None))


def test_build_is_seeded_privately_and_counts_a_tied_head_once():
    from exactstep.config import load_config

    cfg = load_config(None, ["model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                             "model.d_ff=32", "seed=3"])
    state = torch.get_rng_state()
    a, b = build_encoder_decoder(cfg, V), build_encoder_decoder(cfg, V)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    assert a.head_weight is a.embed.weight
    assert a.num_parameters() == sum(p.numel() for p in set(a.parameters()))
    separate = model(share_embeddings=False)
    assert separate.num_parameters() == model().num_parameters() + V * CFG.d_model
