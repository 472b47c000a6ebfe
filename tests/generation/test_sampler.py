"""Q1, E1: the sampler draws addressed tokens from the declared policy, in isolation.

Independent expectations, written out with ``math``: the softmax of the logits over
the temperature, its truncation to the top-k and top-p sets, and the inverse CDF in
token-id order. Over a grid of uniforms ``u = (i + 1/2) / N`` the inverse CDF gives
token ``t`` for a share of the grid within ``1/N`` of its probability, exactly (no
statistics). Addressing: a continuation depends on ``(seed, window, example,
sample)`` and nothing else the process did; the controls are other addresses.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from run_support import TINY_MODEL

from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import draw, policy_probs, sample_group, uniforms
from exactstep.model.decoder import build_model

LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0, 0.5], dtype=np.float32)  # a tie at ids 1, 3


def softmax(z, temperature=1.0):
    m = max(z)
    e = [math.exp((x - m) / temperature) for x in z]
    s = math.fsum(e)
    return [x / s for x in e]


def expected_policy(z, *, temperature=1.0, top_k=0, top_p=1.0):
    """The declared distribution, from the definitions: likeliest first (lower id on
    ties), the top ``k``, then the smallest prefix reaching ``p``, renormalised."""
    p = softmax(list(map(float, z)), temperature)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept = order[:top_k] if top_k else order
    mass = math.fsum(p[i] for i in kept)
    if top_p < 1.0:
        acc, cut = 0.0, []
        for i in kept:
            cut.append(i)
            acc += p[i] / mass
            if acc >= top_p:
                break
        kept = cut
    total = math.fsum(p[i] for i in kept)
    return [p[i] / total if i in kept else 0.0 for i in range(len(p))]


@pytest.mark.parametrize("settings", [
    {}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 2}, {"top_k": 3},
    {"top_p": 0.6}, {"top_p": 0.95, "top_k": 4, "temperature": 1.5}])
def test_the_inverse_cdf_draws_each_token_with_its_declared_probability(settings):
    cfg = GenerationConfig(**settings)
    want = expected_policy(LOGITS, **settings)
    assert policy_probs(LOGITS, cfg).tolist() == pytest.approx(want, abs=1e-12)
    n = 20000
    counts = [0] * LOGITS.size
    for i in range(n):
        counts[draw(LOGITS, (i + 0.5) / n, cfg)[0]] += 1
    for token, p in enumerate(want):
        assert abs(counts[token] / n - p) <= 1.0 / n + 1e-12, (token, counts[token], p)
    # the inverse CDF runs in id order: the smallest uniforms draw the lowest kept id
    first = min(t for t, p in enumerate(want) if p > 0)
    assert draw(LOGITS, 0.0, cfg)[0] == first


def test_greedy_is_the_argmax_and_breaks_ties_by_the_lower_id():
    cfg = GenerationConfig(temperature=0.0)
    assert all(draw(LOGITS, u, cfg)[0] == 1 for u in (0.0, 0.5, 0.999))


def test_the_recorded_log_probability_is_the_models_own():
    """log p of the drawn token under the untempered, untruncated softmax (what the
    KL estimators compare), whatever the sampling policy."""
    p = softmax(list(map(float, LOGITS)))
    for cfg in (GenerationConfig(), GenerationConfig(temperature=0.5, top_k=2)):
        token, logp = draw(LOGITS, 0.3, cfg)
        assert logp == pytest.approx(math.log(p[token]), abs=1e-12)


def model_and_prompt():
    model = build_model(TINY_MODEL, 259, seed=4)
    return model, [256, 72, 101, 108, 108, 111]


def test_a_continuation_depends_on_its_address_alone():
    model, prompt = model_and_prompt()
    cfg = GenerationConfig(samples=3, max_new_tokens=12)

    def group(example, window=0, seed=7):
        return [c.tokens for c in sample_group(model, prompt, cfg, seed=seed, window=window,
                                               example_id=example, stop_ids=(257,))]

    first = group(5)
    torch.manual_seed(123)  # the process's own streams move: no effect
    np.random.seed(9)
    random.seed(1)
    group(6)  # another prompt sampled in between: no effect
    assert group(5) == first
    # one sample alone is the same as that sample within its group
    alone = sample_group(model, prompt, cfg, seed=7, window=0, example_id=5, stop_ids=(257,),
                         samples=1)
    assert alone[0].tokens == first[0]
    # controls: every other part of the address draws other tokens
    assert len(set(first)) == 3
    assert group(5, window=1) != first and group(6) != first and group(5, seed=8) != first
    assert np.array_equal(uniforms(7, 0, 5, 1, 4), uniforms(7, 0, 5, 1, 4))


def test_sampling_is_isolated_e1():
    """Eval mode inside (dropout off), every module's mode and every RNG stream back
    after, no gradient recorded."""
    model, prompt = model_and_prompt()
    model.train()
    model.layers[0].eval()  # a submodule's own mode survives too
    seen = []
    # the embedding runs on every path, the cached one (decode_step) and the whole-row one
    handle = model.embed.register_forward_pre_hook(lambda m, args: seen.append(
        (m.training, torch.is_grad_enabled())))
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    sample_group(model, prompt, GenerationConfig(samples=2, max_new_tokens=3), seed=0,
                 window=0, example_id=0, stop_ids=(257,))
    handle.remove()
    assert seen and all(mode == (False, False) for mode in seen)
    assert model.training and not model.layers[0].training
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1]) and random.getstate() == states[2]
    assert all(p.grad is None for p in model.parameters())


def test_a_continuation_stops_at_its_stop_token():
    model, prompt = model_and_prompt()
    cfg = GenerationConfig(samples=4, max_new_tokens=40)
    full = sample_group(model, prompt, cfg, seed=3, window=0, example_id=0, stop_ids=(999,))
    stop = full[0].tokens[5]  # a token the first continuation draws: a stop it meets
    conts = sample_group(model, prompt, cfg, seed=3, window=0, example_id=0, stop_ids=(stop,))
    assert conts[0].stopped
    for c, f in zip(conts, full, strict=True):
        if stop in f.tokens:  # the same draws, cut at the first stop token
            cut = f.tokens.index(stop) + 1
            assert c.tokens == f.tokens[:cut] and c.stopped
        else:
            assert c.tokens == f.tokens and not c.stopped and len(c.tokens) == 40


def test_the_key_value_cache_is_the_whole_row_forward():
    """``Decoder.decode_step`` (the sampler's cached path): a prompt prefilled, then
    one column at a time, gives the hidden states of the whole-row forward within twice
    the whole-row fp32 forward's own distance from float64 (``spread_bound``); every
    sampled token's recorded log-probability is the whole-row forward's within the
    same kind of bound. Control: a cache missing its first column is far off."""
    from equivalence import spread_bound

    from exactstep.rows.batch import single_segment_batch

    model = build_model(TINY_MODEL, 40, seed=3).eval()
    tokens = torch.randint(3, 40, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(single_segment_batch(tokens))
        exact = model.double()(single_segment_batch(tokens)).float()
        model.float()
        parts, cache = [], None
        for a, b in ((0, 6), (6, 7), (7, 8), (8, 11)):
            hidden, cache = model.decode_step(tokens[:, a:b], cache)
            parts.append(hidden)
        cached = torch.cat(parts, dim=1)
        bound = spread_bound(whole, exact)
        assert float((cached - whole).abs().max()) <= bound
        short = [(k[:, :, 1:], v[:, :, 1:]) for k, v in cache]
        wrong, _ = model.decode_step(tokens[:, -1:], short)
        assert float((wrong[:, 0] - whole[:, -1]).abs().max()) > 100 * bound

    prompt = [1, 5, 9, 4]
    cfg = GenerationConfig(max_new_tokens=6, samples=3)
    conts = sample_group(model, prompt, cfg, seed=0, window=2, example_id=7, stop_ids=(2,))
    for c in conts:
        row = torch.tensor([prompt + list(c.tokens)])
        with torch.no_grad():
            logp = torch.log_softmax(model.logits(model(single_segment_batch(row))), -1)[0]
            exact = torch.log_softmax(model.double().logits(
                model(single_segment_batch(row))), -1)[0]
            model.float()
        at = torch.arange(len(prompt) - 1, row.shape[1] - 1)
        whole = logp[at, row[0, len(prompt):]]
        exact = exact[at, row[0, len(prompt):]]
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        assert float((got - whole.double()).abs().max()) <= spread_bound(whole, exact) + 1e-12


@pytest.mark.parametrize("cross", ["dense", "pairs"])
def test_the_encoder_decoder_cache_is_the_whole_row_forward(cross):
    """``EncoderDecoder.decode_step`` (the source encoded once, cross-attention keys and
    values kept, the decoder one column at a time) gives the hidden states of the
    whole-row forward within twice the whole-row fp32 forward's own distance from float64
    (``spread_bound``), whichever cross-attention the forward uses; the sampler's draws
    through it keep their log-probabilities within the same kind of bound. Control: a
    cache whose cross-attention keys lost the source's first column is far off."""
    from equivalence import spread_bound

    from exactstep.generation.sampler import prompt_batch
    from exactstep.model.encdec import EncoderDecoder

    model = EncoderDecoder(TINY_MODEL, 40, generator=torch.Generator().manual_seed(3),
                           encoder_layers=2, decoder_layers=2, cross_attention=cross).eval()
    source = [5, 9, 4, 7, 2]
    tokens = torch.randint(3, 40, (3, 9), generator=torch.Generator().manual_seed(0))
    batch = prompt_batch(tokens, source, 0)
    with torch.no_grad():
        whole = model(batch)
        exact = model.double()(batch).float()
        model.float()
        parts, cache = [], None
        for a, b in ((0, 4), (4, 5), (5, 6), (6, 9)):
            hidden, cache = model.decode_step(tokens[:, a:b], cache, source=batch.source)
            parts.append(hidden)
        cached = torch.cat(parts, dim=1)
        bound = spread_bound(whole, exact)
        assert float((cached - whole).abs().max()) <= bound
        short = {"cross": [(k[:, :, 1:], v[:, :, 1:]) for k, v in cache["cross"]],
                 "self": [(k[:, :, :-1], v[:, :, :-1]) for k, v in cache["self"]]}
        wrong, _ = model.decode_step(tokens[:, -1:], short)
        assert float((wrong[:, 0] - whole[:, -1]).abs().max()) > 100 * bound

    cfg = GenerationConfig(max_new_tokens=6, samples=3)
    conts = sample_group(model, [1], cfg, seed=0, window=2, example_id=7, stop_ids=(2,),
                         source=source)
    for c in conts:
        row = torch.tensor([[1, *c.tokens]])
        b = prompt_batch(row, source, 0)
        with torch.no_grad():
            logp = torch.log_softmax(model.logits(model(b)), -1)[0]
            exact = torch.log_softmax(model.double().logits(model(b)), -1)[0]
            model.float()
        at = torch.arange(0, row.shape[1] - 1)
        want = logp[at, row[0, 1:]]
        exact = exact[at, row[0, 1:]]
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        assert float((got - want.double()).abs().max()) <= spread_bound(want, exact) + 1e-12
