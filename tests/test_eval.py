"""E1: evaluation is isolated; L5: perplexity comes from globally summed NLL and tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from exactstep.data.tokenizer import ByteTokenizer
from exactstep.eval import evaluate, unigram_bits
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.stream import eval_batches

TOK = ByteTokenizer()
CFG = ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64)


def examples(n: int = 12, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        body = rng.integers(0, 256, size=int(rng.integers(5, 70)))
        tokens = np.concatenate([[TOK.bos_id], body, [TOK.eos_id]]).astype(np.int64)
        out.append(Example(example_id=i, tokens=tokens))
    return out


def batches(exs):
    return list(eval_batches(exs, BatchConfig(seq_len=32, rows=3), pad_id=TOK.pad_id))


class RandomProbe(torch.nn.Module):
    """Records the mode and grad state seen by the forward, and draws randomness."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.seen: list[tuple[bool, bool]] = []

    @property
    def head_weight(self):
        return self.inner.head_weight

    def forward(self, batch):
        self.seen.append((self.training, torch.is_grad_enabled()))
        torch.rand(3)  # e.g. dropout would draw here
        return self.inner(batch)


def test_evaluation_is_isolated() -> None:
    model = RandomProbe(build_model(CFG, TOK.vocab_size, seed=0))
    model.train()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    result = evaluate(model, batches(examples()), device=torch.device("cpu"),
                      max_tokens=10**9, pad_id=TOK.pad_id)
    assert result.tokens > 0
    assert model.seen and all(mode == (False, False) for mode in model.seen)  # eval, no_grad
    assert model.training  # mode restored
    assert torch.equal(torch.get_rng_state(), rng_before)  # RNG untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_negative_control_unisolated_loop_moves_the_rng() -> None:
    model = RandomProbe(build_model(CFG, TOK.vocab_size, seed=0))
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    with torch.no_grad():  # a loop without RNG isolation
        for batch in batches(examples()):
            model(batch)
    assert not torch.equal(torch.get_rng_state(), rng_before)


def plain_nll(model, batch) -> tuple[float, int]:
    """Plain PyTorch: (gold NLL sum in float64, supervised rows) of one held-out batch."""
    with torch.no_grad():
        logits = model(batch) @ model.head_weight.t()  # [B, T, V]
    labels = batch.labels.flatten()
    keep = labels != -100
    nll = F.cross_entropy(logits.flatten(0, 1)[keep], labels[keep], reduction="none")
    return float(nll.double().sum()), int(keep.sum())


def test_perplexity_from_global_sums_not_batch_means() -> None:
    model = build_model(CFG, TOK.vocab_size, seed=1)
    bs = batches(examples(20, seed=3))
    total = evaluate(model, bs, device=torch.device("cpu"), max_tokens=10**9, pad_id=TOK.pad_id)
    sums = [plain_nll(model, b) for b in bs]
    nll, tokens = math.fsum(s for s, _ in sums), sum(n for _, n in sums)
    assert total.tokens == tokens
    assert total.gold_nll_sum == pytest.approx(nll, rel=1e-6)
    assert total.loss == pytest.approx(nll / tokens, rel=1e-6)
    assert total.perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-6)
    assert total.bits_per_token == pytest.approx(nll / tokens / math.log(2), rel=1e-6)
    # negative controls (L5): averaging per-batch losses or perplexities differs
    assert len({n for _, n in sums}) > 1  # batches weigh tokens unequally
    per_batch_loss = sum(s / n for s, n in sums) / len(sums)
    per_batch_ppl = sum(math.exp(s / n) for s, n in sums) / len(sums)
    assert total.loss != pytest.approx(per_batch_loss, rel=1e-6)
    assert total.perplexity != pytest.approx(per_batch_ppl, rel=1e-6)


def test_unigram_baseline_matches_hand_count() -> None:
    train = examples(10, seed=5)
    val = examples(4, seed=6)
    counts = np.ones(TOK.vocab_size)
    for ex in train:
        counts += np.bincount(ex.tokens[1:], minlength=TOK.vocab_size)
    p = counts / counts.sum()
    targets = np.concatenate([ex.tokens[1:] for ex in val])
    expected = -np.log2(p[targets]).mean()
    got = unigram_bits(train, batches(val), TOK.vocab_size, max_tokens=10**9)
    assert got == pytest.approx(expected, rel=1e-9)


def test_the_baseline_of_a_family_that_rewrites_targets_is_fit_on_its_targets():
    """R8: span corruption's targets hold sentinels, which raw text never does; the
    summary's unigram is fit on the compiled training labels, counted here by hand.
    Negative control: the raw-text fit (the causal families') is a different figure."""
    import numpy as np

    from exactstep.config import load_config
    from exactstep.eval import Validator, unigram_bits
    from exactstep.families import open_family, resolve
    from exactstep.rows.stream import eval_batches

    cfg = resolve(load_config(None, ["objective.family=span", "data.max_docs=60",
                                     "data.val_fraction=0.2", "batch.seq_len=64",
                                     "batch.rows=4", "train.eval_tokens=400"]))
    p = open_family(cfg)
    vocab = p.tokenizer.vocab_size
    validator = Validator(None, p.data.train, p.data.val, cfg.batch, p.tokenizer.pad_id, vocab,
                          "cpu", cfg.train.eval_tokens, compiler=p.compiler)
    from exactstep.rows.stream import RowStream

    counts = np.ones(vocab)  # the whole split (fewer targets than the fit's cap)
    for batch in RowStream(p.data.train, cfg.batch, pad_id=p.tokenizer.pad_id, seed=0,
                           repeat=False, compiler=p.compiler):
        for t in batch.labels[batch.labels >= 0].tolist():
            counts[t] += 1
    log2p = np.log2(counts / counts.sum())
    held = []
    for batch in eval_batches(p.data.val, cfg.batch, pad_id=p.tokenizer.pad_id,
                              compiler=p.compiler):
        if len(held) >= cfg.train.eval_tokens:
            break
        held += batch.labels[batch.labels >= 0].tolist()
    expected = -sum(log2p[t] for t in held) / len(held)
    assert validator.baseline_bits() == pytest.approx(expected, rel=1e-12)
    raw = unigram_bits(p.data.train, eval_batches(p.data.val, cfg.batch, pad_id=p.tokenizer.pad_id,
                                                  compiler=p.compiler), vocab, cfg.train.eval_tokens)
    assert raw > expected + 0.5  # sentinels are rare under a raw-text fit
