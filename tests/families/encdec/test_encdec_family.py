"""The encoder-decoder family end to end (R8, L2, U1, E1): Harvard smoothing's worked
row, greedy decoding, exact accumulation, the data sources and ``exactstep inspect``."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from equivalence import FP64_UNIT, cross_entropy_bounds, gamma

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.data.pairs import (
    Pair,
    is_heldout_number,
    load_pairs_jsonl,
    number_words,
    numwords_pairs,
)
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError
from exactstep.families import open_family, resolve
from exactstep.families.encdec.compiler import (
    EncDecCompiler,
    PairPiece,
    compile_pair_batch,
    encode_pairs,
)
from exactstep.families.encdec.family import greedy_exact_match
from exactstep.model.config import ModelConfig
from exactstep.model.encdec import EncoderDecoder, greedy_decode
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.cross_entropy import fused_row_losses
from exactstep.objective.smoothing import Smoothing, target_distribution
from exactstep.parallel.agreement import empty_microbatch
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.config import BatchConfig
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

TOK = ByteTokenizer()
BOS, EOS, PAD, V = 256, 257, 258, 259
CFG = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)
TINY = ["model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32",
        "batch.seq_len=48", "batch.rows=2", "encdec.source_len=16", "encdec.n_train=40",
        "encdec.n_heldout=6", "encdec.max_value=99", "train.device=cpu"]


def tiny_model(seed: int = 0) -> EncoderDecoder:
    return EncoderDecoder(CFG, V, generator=torch.Generator().manual_seed(seed))


# -- L2: the reference article's Harvard smoothing row ---------------------------------


def harvard_reference_row(size: int, padding_idx: int, smoothing: float, gold: int) -> list:
    """The article's recipe, step by step, in plain Python: fill ``smoothing / (size -
    2)``, put ``1 - smoothing`` on the gold class, zero the PAD column (a row whose
    target is PAD would be zeroed whole: it is never a supervised row here)."""
    row = [smoothing / (size - 2)] * size
    row[gold] = 1.0 - smoothing
    row[padding_idx] = 0.0
    return row


def test_harvard_smoothing_reproduces_the_reference_row_exactly():
    """q_gold = 1 - eps, q_PAD = 0, every other class eps / (V - 2), with the
    criterion's eps = 0.1 over this family's vocabulary (V = 259, PAD = 258)."""
    sm = Smoothing.resolve("harvard", 0.1, V, PAD)
    gold = ord("t")
    q = target_distribution(sm, gold)
    assert q.tolist() == harvard_reference_row(V, PAD, 0.1, gold)
    assert q[gold] == 0.9 and q[PAD] == 0.0 and q[0] == 0.1 / 257
    assert abs(float(q.sum()) - 1.0) <= gamma(V - 1, FP64_UNIT)  # a float64 sum of V terms
    # the toy row usually printed with it: V = 5, PAD = 0, eps = 0.4, gold = 2
    toy = target_distribution(Smoothing.resolve("harvard", 0.4, 5, 0), 2)
    assert toy.tolist() == [0.0, 0.4 / 3, 0.6, 0.4 / 3, 0.4 / 3]
    # negative control: PyTorch's label_smoothing (uniform over V) is another row
    uniform = target_distribution(Smoothing.resolve("uniform", 0.1, V, PAD), gold)
    assert uniform.tolist() != q.tolist()


def test_the_family_trains_on_the_harvard_row():
    """On a compiled encdec batch the fused loss's logit gradient of every supervised
    row is softmax(z) - q with q the reference row; ignored rows get exactly 0."""
    examples, _ = encode_pairs([Pair("7", "seven"), Pair("40", "forty")], TOK, seq_len=16,
                               source_len=8, overlong="split")
    batch = EncDecCompiler(source_len=8, pad_id=PAD, source_pad_id=PAD).compile(
        [[_whole(examples[0]), _whole(examples[1])]], examples, BatchConfig(seq_len=16, rows=1),
        pad_id=PAD, weighted=False)
    labels = batch.labels.reshape(-1)
    z = torch.randn(labels.shape[0], V, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float32, requires_grad=True)
    cfg = ObjectiveConfig(smoothing="harvard", label_smoothing=0.1)
    ce, _ = fused_row_losses(z, torch.eye(V), labels, cfg, pad_id=PAD)
    ce.sum().backward()
    for i, label in enumerate(labels.tolist()):
        if label == IGNORE_INDEX:
            assert torch.equal(z.grad[i], torch.zeros(V))
            continue
        q = torch.tensor(harvard_reference_row(V, PAD, 0.1, label))
        # both sides round softmax(z) - q in fp32 (z @ I is exact): twice the entrywise
        # bound of ``cross_entropy_bounds``, ~p * 2.4e-4 + 1e-7 at V = 259
        _, bound = cross_entropy_bounds(z[i].detach()[None], q[None], torch.ones(1))
        assert ((z.grad[i].double() - (F.softmax(z[i].detach(), -1) - q)).abs()
                <= 2 * bound[0]).all()


def _whole(example):
    from exactstep.rows.packing import Piece

    return Piece(example=example.example_id, offset=0, length=len(example), piece=0)


# -- greedy decoding (E1) ------------------------------------------------------------


def reference_greedy(model, source: list[int], steps: int) -> list[int]:
    """Decoding through the packed training path: each step compiles the pair
    (source, BOS + answer so far + a dummy last token) and reads the argmax at the
    last real decoder column."""
    answer: list[int] = []
    for _ in range(steps):
        target = np.array([BOS, *answer, 0], dtype=np.int64)
        batch = compile_pair_batch([[PairPiece(0, 0, np.array(source), target)]],
                                   seq_len=len(target) + 3, source_len=len(source) + 2,
                                   pad_id=PAD, source_pad_id=PAD)
        logits = model.logits(model(batch))[0, len(target) - 2]
        token = int(logits.argmax())
        if token == EOS:
            return answer
        answer.append(token)
    return answer + [-1]


def test_greedy_decoding_equals_decoding_through_the_training_forward():
    model = tiny_model(4)
    sources = [[*b"12", EOS], [*b"7", EOS], [*b"305", EOS], [EOS]]
    with torch.no_grad():
        got = greedy_decode(model, sources, bos_id=BOS, eos_id=EOS, source_pad_id=PAD,
                            max_new_tokens=5)
        want = [reference_greedy(model, s, 5) for s in sources]
    assert got == want


def test_exact_match_counts_whole_answers(monkeypatch):
    """An answer counts only when it is exactly the target between BOS and EOS."""
    import exactstep.families.encdec.family as encdec_family

    examples, _ = encode_pairs([Pair("1", "ab"), Pair("2", "c"), Pair("3", "de")], TOK,
                               seq_len=16, source_len=8, overlong="split")
    answers = [[*b"ab"], [*b"c", 0], [*b"de", -1]]  # right, one too long, never ended
    seen = {}

    def fake(model, sources, **kw):
        seen["sources"] = [list(s) for s in sources]
        return answers

    monkeypatch.setattr(encdec_family, "greedy_decode", fake)
    score = greedy_exact_match(tiny_model(), examples, TOK, device="cpu", max_new_tokens=4,
                               source_pad_id=PAD)
    assert score == 1 / 3
    assert seen["sources"] == [[*b"1", EOS], [*b"2", EOS], [*b"3", EOS]]


def test_exact_match_changes_no_state_e1():
    model = tiny_model(4)
    examples, _ = encode_pairs([Pair("12", "x"), Pair("305", "z")], TOK, seq_len=16,
                               source_len=8, overlong="split")
    model.train()
    model.encoder[0].eval()  # a submodule's own mode is restored too
    state = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    greedy_exact_match(model, examples, TOK, device="cpu", max_new_tokens=3, source_pad_id=PAD)
    assert model.training and not model.encoder[0].training
    assert random.getstate() == state[0] and torch.equal(torch.get_rng_state(), state[2])
    assert np.array_equal(np.random.get_state()[1], state[1])
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in model.parameters())


# -- U1: K microbatches = one batch ---------------------------------------------------


def rows_of(batch: Batch, rows: slice) -> Batch:
    """Rows ``rows`` of ``batch``, both sides (the segments and the tensors)."""
    def cut(t):
        return None if t is None else t[rows]

    source = batch.source
    return replace(batch.map(cut), segments=batch.segments[rows],
                   source=replace(source.map(cut), segments=source.segments[rows]))


def one_window(batches: list[Batch], reduction: str) -> list[torch.Tensor]:
    model = tiny_model(2)
    update = UpdateConfig(optimizer="sgd", lr=1.0, momentum=0.0, schedule="constant",
                          warmup=0, clip=0.0, weight_decay=0.0, accum=len(batches))
    optimizer, _ = build_optimizer(model, update)
    engine = UpdateEngine(model, optimizer, build_schedule(update, 10),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), update,
                          ObjectiveConfig(reduction=reduction), device="cpu", pad_id=PAD)
    engine.run_window(batches, 0)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("reduction,equal", [("token_mean", True), ("microbatch_mean", False)])
def test_accumulated_microbatches_equal_one_batch_u1(reduction, equal):
    """U1 for this family; ``microbatch_mean`` (a mean of microbatch means, another
    objective) is the negative control: the same comparison must fail."""
    pairs = [Pair(str(n), number_words(n)) for n in (3, 17, 40, 99, 5, 61)]
    examples, _ = encode_pairs(pairs, TOK, seq_len=24, source_len=8, overlong="split")
    rows = [[_whole(examples[0])], [_whole(examples[1]), _whole(examples[4])],
            [_whole(examples[2]), _whole(examples[5])], [_whole(examples[3])]]
    whole = EncDecCompiler(source_len=8, pad_id=PAD, source_pad_id=PAD).compile(
        rows, examples, BatchConfig(seq_len=24, rows=4), pad_id=PAD, weighted=False)
    split = [rows_of(whole, slice(0, 1)), rows_of(whole, slice(1, 4))]
    assert split[0].num_targets() != split[1].num_targets()
    a, b = one_window(split, reduction), one_window([whole], reduction)
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))
    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    assert (worst <= 1e-5) == equal, worst


def test_a_padding_microbatch_runs_without_a_source():
    """D1: a rank that ran out of data pads with empty microbatches (no encoder side)."""
    hidden = tiny_model()(empty_microbatch(2, 8, PAD))
    assert hidden.shape == (2, 8, 16) and bool(torch.isfinite(hidden).all())


# -- data ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,words", [
    (0, "zero"), (13, "thirteen"), (40, "forty"), (101, "one hundred one"),
    (2048, "two thousand forty-eight"), (910_000, "nine hundred ten thousand"),
    (1_000_001, "one million one"), (999_999_999_999, "nine hundred ninety-nine billion "
     "nine hundred ninety-nine million nine hundred ninety-nine thousand nine hundred "
     "ninety-nine")])
def test_number_words(n, words):
    assert number_words(n) == words


def test_numwords_is_seeded_and_its_heldout_numbers_never_train():
    train = numwords_pairs(3, 500, split="train", max_value=999)
    held = numwords_pairs(3, 50, split="heldout", max_value=999)
    assert train == numwords_pairs(3, 500, split="train", max_value=999)
    assert train != numwords_pairs(4, 500, split="train", max_value=999)
    assert not {p.source for p in train} & {p.source for p in held}
    assert all(is_heldout_number(int(p.source)) for p in held)
    assert len({p.source for p in held}) == 50
    assert all(p.target == number_words(int(p.source)) for p in train + held)


def test_pairs_jsonl_reads_pairs_and_names_bad_lines(tmp_path):
    good = tmp_path / "pairs.jsonl"
    good.write_text(json.dumps({"source": "a", "target": "b", "weight": 2}) + "\n\n"
                    + json.dumps({"source": "c", "target": "d"}) + "\n")
    assert load_pairs_jsonl(good) == [Pair("a", "b", "pairs.jsonl:1", 2.0),
                                      Pair("c", "d", "pairs.jsonl:3")]
    for line, message in [('{"source": "a"}', 'pairs.jsonl:1: "target" must be a non-empty'
                                              " string; got nothing"),
                          ('{"source": "", "target": "b"}', "got an empty string"),
                          ('[1]', "expected an object"), ('{"source": 1, "target": "b"}',
                                                          "got a JSON number")]:
        good.write_text(line + "\n")
        with pytest.raises(DataError, match=message):
            load_pairs_jsonl(good)


def test_a_pairs_jsonl_trains_through_the_family(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"source": str(n), "target": number_words(n)}) + "\n"
                            for n in range(60)))
    cfg = resolve(load_config(None, [*TINY, "objective.family=encdec", f"data.source={path}",
                                     "data.val_fraction=0.2"]))
    parts = open_family(cfg)
    assert parts.data.section["kind"] == "pairs" and parts.data.val
    assert len(parts.data.train) + len(parts.data.val) == 60


# -- the command line ---------------------------------------------------------------


def test_inspect_shows_both_sides(capsys):
    assert main(["inspect", "--rows", "0:1", "--set", "objective.family=encdec", *sum(
        (["--set", s] for s in TINY), [])]) == 0
    out = capsys.readouterr().out
    assert "encoder side (row 0)" in out and "cross-attend to source cols" in out
    assert "source segment 1: example" in out and "never attended, never scored" in out
    assert "→" in out  # the decoder's input -> target columns


def test_the_shipped_demo_config_resolves_to_the_family():
    from importlib import resources

    path = resources.files("exactstep") / "configs" / "encdec_numwords.toml"
    cfg = resolve(load_config(str(path), ["encdec.n_train=20"]))
    assert (cfg.objective.family, cfg.data.source) == ("encdec", "numwords")
    assert (cfg.objective.smoothing, cfg.objective.label_smoothing) == ("harvard", 0.1)
    parts = open_family(cfg)
    assert len(parts.data.val) == cfg.encdec.n_heldout == 200
    longest = max(len(e.tokens) - 2 for e in parts.data.val)  # the answer between BOS/EOS
    assert longest < cfg.encdec.max_new_tokens
