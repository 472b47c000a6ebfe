"""BART denoising (R9; R1, R3, R6, R7, S5): every noising function and their declared
composition against a plain-Python oracle fed the same addressed draws, exactly, on
hundreds of random pieces and the edges (a one-token document, Poisson draws of 0 and
of more than the piece, a document split inside a span, a piece with no sentence
boundary); each function's defining invariant; rows that always fit; addressed draws;
the refusals; and wrong variants (an oracle with one deliberate difference, a compiler
without the shift) that these checks catch."""

from __future__ import annotations

import math
from fractions import Fraction

import bart_reference as ref
import numpy as np
import pytest
from bart_reference import BART_STREAM, compose, draws_of, expected_sides, raw_of
from families.corruption_support import (
    BOS,
    EOS,
    PAD,
    NoShiftMixin,
    Recording,
    actual_of,
    assert_another_seed_or_epoch_draws_anew,
    assert_r7_refuses_broken_rows,
    assert_same_in_any_row_rank_or_resume,
    draw_rows,
    first_batch,
    held_out_pieces,
    oracle_rows,
    sides_by_piece,
)
from families.corruption_support import corpus as byte_corpus
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.bart import compiler as bart
from exactstep.families.bart.compiler import BartCompiler, piece_generator
from exactstep.families.bart.config import NOISE_FUNCTIONS, BartConfig, row_shape
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

MASK = 259
VOCAB = 260
ALL = ("sentence_permutation", "token_deletion", "text_infilling", "token_masking",
       "document_rotation")
#: Bytes that make sentences: letters, spaces, punctuation and newlines.
ALPHABET = [*b"abcdefgh", 32, 32, 32, 46, 33, 63, 10]


def compiler(seed: int = 0, config: BartConfig | None = None) -> BartCompiler:
    return BartCompiler(config or BartConfig(), seed=seed, bos_id=BOS, eos_id=EOS,
                        mask_id=MASK)


def params(config: BartConfig) -> dict:
    return {"token_masking_rate": config.token_masking_rate,
            "token_deletion_rate": config.token_deletion_rate,
            "text_infilling_rate": config.text_infilling_rate,
            "poisson_lambda": config.poisson_lambda}


def sentence_text(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.array(ALPHABET, dtype=np.int64)[rng.integers(0, len(ALPHABET), size=n)]


def corpus(lengths, seed: int = 0) -> list[Example]:
    return byte_corpus(lengths, seed, body=sentence_text)


def reference_piece(config: BartConfig, example: Example, piece: Piece, seed: int) -> list[int]:
    raw = raw_of(example.tokens.tolist(), piece.offset, piece.length)
    draws = draws_of(seed, piece.epoch, example.example_id, piece.piece)
    return compose(raw, config.noise, params(config), draws, MASK) + [EOS]


# --------------------------------------------------------------------------- by hand


def test_hand_written_functions():
    """Each function on ``b"Hi. Yo! Ok"`` with draws written out."""

    class Fixed:
        def __init__(self, random=(), poisson=(), permutation=(), integers=0):
            self.r, self.p, self.perm, self.i = list(random), list(poisson), list(permutation), \
                integers

        def random(self, n):
            return self.r[:n]

        def poisson(self, lam, n):
            out, self.p = self.p[:n], self.p[n:]
            return out

        def permutation(self, n):
            return self.perm[:n] if self.perm else list(range(n))

        def integers(self, n):
            return self.i

    x = list(b"Hi. Yo! Ok")
    assert ref.sentences(x) == [list(b"Hi. "), list(b"Yo! "), list(b"Ok")]
    assert ref.sentence_permutation(x, Fixed(permutation=[2, 0, 1])) == list(b"OkHi. Yo! ")
    assert ref.document_rotation(x, Fixed(integers=4)) == list(b"Yo! OkHi. ")
    u = [0.9, 0.1, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.05]
    assert ref.token_masking(x, 0.15, Fixed(random=u), MASK) == [*b"H", MASK, *b". Yo! O", MASK]
    assert ref.token_deletion(x, 0.15, Fixed(random=u)) == list(b"H. Yo! O")
    # 10 tokens at 0.3: budget 3; lengths 0, 5 -> 0, 3 (cut); 7 kept + 2 spans = 9 slots
    out = ref.text_infilling(x, 0.3, 3.0, Fixed(poisson=[0, 5, 1], permutation=[8, 2]), MASK)
    # span 1 (". Y") at slot 2, the zero-length span 0 inserts a mask at slot 8
    assert out == [*b"Hi", MASK, *b"o! Ok", MASK]
    # the compiler's pieces agree on the same hand-made inputs
    assert bart.sentence_bounds(np.array(x)) == [4, 8, 10]
    lengths, slots = np.array([0, 3]), np.array([8, 2])
    assert bart.infill(np.array(x), lengths, slots, MASK).tolist() == out


def test_the_default_is_bart_larges_recipe():
    config = BartConfig()
    assert config.noise == ("sentence_permutation", "text_infilling")
    assert (config.text_infilling_rate, config.poisson_lambda) == (0.3, 3.0)
    assert [f["name"] for f in config.composition()] == list(config.noise)


# --------------------------------------------------------------------------- the oracle


def oracle_of(batch, examples, seq_len, seed, config):
    rows, draws = oracle_rows(batch, examples, seed, draws_of)
    return expected_sides(rows, draws, seq_len=seq_len, noise=config.noise,
                          params=params(config), mask=MASK, bos=BOS, eos=EOS, pad=PAD)


@pytest.mark.parametrize("config", [
    BartConfig(),
    BartConfig(noise=ALL, token_masking_rate=0.2, token_deletion_rate=0.1),
    BartConfig(noise=("document_rotation", "token_masking", "text_infilling"),
               text_infilling_rate=0.5, poisson_lambda=1.0),
], ids=["bart_large", "all_five", "rotation_first"])
def test_the_compiler_equals_the_oracle_on_a_stream(config):
    """Whole batches (both sides, positions, segments, labels) against the oracle, over
    rows holding several pieces and documents split into pieces, across an epoch."""
    examples = corpus([3, 7, 20, 41, 150, 9, 1, 66, 12, 5, 33, 90, 0])
    cfg = BatchConfig(seq_len=48, rows=3, buffer=6)
    stream = RowStream(examples, cfg, pad_id=PAD, seed=5, vocab_size=VOCAB,
                       compiler=Recording(compiler(seed=5, config=config)))
    packed = split = 0
    for _ in range(14):
        batch = stream.next_batch()
        packed += sum(len(s) > 1 for s in batch.segments)
        split += sum(seg.piece > 0 for row in batch.segments for seg in row)
        assert actual_of(batch) == oracle_of(batch, examples, 48, 5, config)
    assert packed >= 3 and split >= 3 and stream.planner.epoch >= 1


# --------------------------------------------------------------------------- properties

compositions = st.permutations(ALL).flatmap(
    lambda order: st.integers(1, len(order)).map(lambda k: tuple(order[:k])))


@st.composite
def piece_case(draw):
    noise = draw(compositions)
    config = BartConfig(
        noise=noise,
        token_masking_rate=draw(st.sampled_from([0.0, 0.15, 0.5, 1.0])),
        token_deletion_rate=draw(st.sampled_from([0.0, 0.15, 0.5, 1.0])),
        text_infilling_rate=draw(st.sampled_from([0.05, 0.3, 0.7, 1.0])),
        poisson_lambda=draw(st.sampled_from([0.05, 0.5, 3.0, 50.0])),
    ) if not set(noise) <= {"token_masking", "token_deletion"} else BartConfig(
        noise=noise, token_masking_rate=draw(st.sampled_from([0.15, 1.0])),
        token_deletion_rate=draw(st.sampled_from([0.15, 1.0])))
    n = draw(st.integers(0, 120))
    body = draw(st.lists(st.sampled_from(ALPHABET), min_size=n, max_size=n))
    offset = draw(st.integers(0, n + 1))
    length = draw(st.integers(1, n + 2 - offset)) if offset < n + 2 else 1
    return config, body, offset, length


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=piece_case(), seed=st.integers(0, 2**31), epoch=st.integers(0, 3),
       example_id=st.integers(0, 10**6), piece_index=st.integers(0, 5))
def test_compiler_equals_reference_on_random_pieces(case, seed, epoch, example_id, piece_index):
    """Any composition (order and subset), rates from 0 to 1, lambda from 0.05 (mostly
    zero-length spans) to 50 (spans longer than the piece), any piece of a document
    (offsets inside it: a split), exactly equal to the oracle."""
    config, body, offset, length = case
    example = Example(example_id, np.array([BOS, *body, EOS], dtype=np.int64))
    piece = Piece(0, offset, length, piece_index, epoch=epoch)
    got = compiler(seed, config).noise_piece(example, piece)
    assert got.inputs.tolist() == reference_piece(config, example, piece, seed)
    assert got.targets.tolist() == raw_of(example.tokens.tolist(), offset, length) + [EOS]
    assert len(got.inputs) <= len(got.targets)  # nothing ever lengthens a piece


def noised(name: str, x: list[int], seed: int, **rates) -> tuple[list[int], list[int]]:
    """``(compiler, oracle)`` of one function alone on ``x``."""
    config = BartConfig(noise=(name,), **rates)
    got = bart.noise(np.array(x, dtype=np.int64), config, np.random.default_rng(seed), MASK)
    want = compose(x, (name,), params(config), ref.NumpyDraws(np.random.default_rng(seed)), MASK)
    return got.tolist(), want


texts = st.lists(st.sampled_from(ALPHABET), max_size=150)


@settings(max_examples=200, deadline=None)
@given(x=texts, seed=st.integers(0, 2**31), rate=st.floats(0.0, 1.0))
def test_masking_keeps_length_and_masks_only(x, seed, rate):
    got, want = noised("token_masking", x, seed, token_masking_rate=max(rate, 1e-9))
    assert got == want and len(got) == len(x)
    assert all(g in (t, MASK) for g, t in zip(got, x, strict=True))


def is_subsequence(small: list[int], big: list[int]) -> bool:
    it = iter(big)
    return all(t in it for t in small)


@settings(max_examples=200, deadline=None)
@given(x=texts, seed=st.integers(0, 2**31), rate=st.floats(1e-9, 1.0))
def test_deletion_leaves_a_subsequence(x, seed, rate):
    got, want = noised("token_deletion", x, seed, token_deletion_rate=rate)
    assert got == want and is_subsequence(got, x) and MASK not in got


@settings(max_examples=200, deadline=None)
@given(x=texts, seed=st.integers(0, 2**31))
def test_permutation_is_a_permutation_of_sentences(x, seed):
    got, want = noised("sentence_permutation", x, seed)
    assert got == want
    parts = ref.sentences(x)
    assert sorted(map(tuple, parts)) == sorted(map(tuple, sentence_chunks(got, parts, seed)))
    if len(parts) <= 1:  # no boundary inside: nothing moves
        assert got == x


def sentence_chunks(out: list[int], parts: list[list[int]], seed: int) -> list[list[int]]:
    """The output cut where the drawn order says each input sentence lies."""
    order = np.random.default_rng(seed).permutation(len(parts)).tolist()
    chunks, at = [], 0
    for i in order:
        chunks.append(out[at:at + len(parts[i])])
        at += len(parts[i])
    assert at == len(out)
    return chunks


@settings(max_examples=200, deadline=None)
@given(x=texts, seed=st.integers(0, 2**31))
def test_rotation_is_a_rotation(x, seed):
    got, want = noised("document_rotation", x, seed)
    assert got == want and len(got) == len(x)
    assert not x or any(got == x[k:] + x[:k] for k in range(len(x)))


@settings(max_examples=200, deadline=None)
@given(x=texts, seed=st.integers(0, 2**31), rate=st.floats(1e-9, 1.0),
       lam=st.sampled_from([0.01, 0.3, 1.0, 3.0, 7.5, 500.0]))
def test_infilling_covers_its_budget_with_at_most_that_many_masks(x, seed, rate, lam):
    """``ceil(rate * n)`` tokens covered, each span one ``<mask>``, the uncovered tokens in
    order, never longer than the piece (the row bound)."""
    got, want = noised("text_infilling", x, seed, text_infilling_rate=rate, poisson_lambda=lam)
    assert got == want
    budget = math.ceil(Fraction(str(rate)) * len(x))
    masks = got.count(MASK)
    assert len(got) - masks == len(x) - budget  # the kept tokens
    assert (masks >= 1) == (budget >= 1) and masks <= budget and len(got) <= len(x)
    assert is_subsequence([t for t in got if t != MASK], x)


# --------------------------------------------------------------------------- edges


def test_a_one_token_document_and_an_empty_one():
    for noise in [ALL, ("text_infilling",), ("document_rotation", "sentence_permutation")]:
        config = BartConfig(noise=noise, text_infilling_rate=1.0)
        for body in ([ord("a")], []):
            example = Example(3, np.array([BOS, *body, EOS], dtype=np.int64))
            piece = Piece(0, 0, len(example), 0)
            got = compiler(1, config).noise_piece(example, piece)
            assert got.inputs.tolist() == reference_piece(config, example, piece, 1)
            assert got.targets.tolist() == [*body, EOS]
    # one token, infilled at rate 1: the token is the whole span
    config = BartConfig(noise=("text_infilling",), text_infilling_rate=1.0)
    example = Example(0, np.array([BOS, 97, EOS], dtype=np.int64))
    assert compiler(0, config).noise_piece(example, Piece(0, 0, 3, 0)).inputs.tolist() == \
        [MASK, EOS]


def test_the_budget_is_the_rate_as_written():
    """``ceil(0.07 * 100)`` is 7, although ``0.07 * 100`` is ``7.000000000000001`` in
    floats: the budget reads the rate as written, in the compiler and the oracle."""
    assert bart.infilling_budget(100, 0.07) == 7 and math.ceil(100 * 0.07) == 8
    assert [bart.infilling_budget(n, 0.3) for n in (0, 1, 3, 10, 11)] == [0, 1, 1, 3, 4]
    x = list(range(100))
    got, want = noised("text_infilling", x, 0, text_infilling_rate=0.07, poisson_lambda=500.0)
    assert got == want and len(got) == 100 - 7 + 1


def test_poisson_draws_of_zero_and_of_more_than_the_piece():
    """lambda 0.01: nearly every draw is 0, so zero-length spans (inserted masks) come
    first and are capped; lambda 500: the first span covers the whole budget."""
    x = list(b"abcdefghijklmnopqrst")
    zeros_seen = False
    for seed in range(200):
        rng = np.random.default_rng(seed)
        lengths, slots = bart.infilling_spans(len(x), 0.3, 0.01, rng)
        zeros_seen |= bool((lengths == 0).any())
        assert len(lengths) <= 6 and int(lengths.sum()) == 6
        got, want = noised("text_infilling", x, seed, text_infilling_rate=0.3,
                           poisson_lambda=0.01)
        assert got == want
    assert zeros_seen
    for seed in range(20):
        lengths, _ = bart.infilling_spans(len(x), 0.3, 500.0, np.random.default_rng(seed))
        assert lengths.tolist() == [6]  # one draw of ~500, cut to the budget
        got, want = noised("text_infilling", x, seed, text_infilling_rate=0.3,
                           poisson_lambda=500.0)
        assert got == want and got.count(MASK) == 1 and len(got) == 15


def test_a_document_split_inside_a_span_is_noised_per_piece():
    """A long document split by the planner: the row boundary may fall where an unsplit
    document's span would run on; each piece is noised alone, from its own address, and
    equals the oracle on that piece."""
    config = BartConfig(noise=("text_infilling",), text_infilling_rate=0.5, poisson_lambda=8.0)
    examples = corpus([400])
    cfg = BatchConfig(seq_len=32, rows=1, buffer=2)
    c = compiler(3, config)
    pieces = 0
    for batch in RowStream(examples, cfg, pad_id=PAD, seed=3, repeat=False, compiler=c):
        for seg, enc in zip(batch.segments[0], batch.source.segments[0], strict=True):
            example = examples[seg.example_id]
            inputs = batch.source.input_ids[0, enc.start:enc.stop].tolist()
            raw = raw_of(example.tokens.tolist(), seg.offset, 10**9)[: seg.length - 1]
            want = compose(raw, config.noise, params(config),
                           draws_of(3, 0, seg.example_id, seg.piece), MASK) + [EOS]
            assert inputs == want, (seg.piece, seg.offset)
            pieces += 1
    assert pieces >= 10


def test_a_piece_without_a_sentence_boundary_is_not_permuted():
    x = list(b"no boundary here,just words and a trailing period.")
    got, want = noised("sentence_permutation", x, 7)
    assert got == want == x
    assert ref.sentences(x) == [x]


# --------------------------------------------------------------------------- rows


@st.composite
def stream_case(draw):
    lengths = draw(st.lists(st.integers(0, 200), min_size=1, max_size=14))
    config = BartConfig(noise=draw(compositions), text_infilling_rate=0.4,
                        poisson_lambda=draw(st.sampled_from([0.2, 3.0])))
    cfg = draw_rows(draw, draw(st.integers(3, 80)))
    return lengths, cfg, config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=stream_case())
def test_every_row_fits_both_sides_and_every_target_is_its_piece(case):
    """Whatever the pieces, the charges keep both sides within ``seq_len``; each
    decoder target is its piece's original raw tokens + EOS; R7 passes; every raw
    token is a target once."""
    lengths, cfg, config = case
    c = compiler(1, config)
    examples = corpus(lengths, seed=len(lengths))
    stream = RowStream(examples, cfg, pad_id=PAD, seed=2, repeat=False, vocab_size=VOCAB,
                       compiler=c)
    targets = 0
    for batch in stream:
        c.check(batch, VOCAB, cfg)
        assert batch.source.shape[1] == batch.shape[1] == cfg.seq_len
        for b, row in enumerate(batch.segments):
            for d in row:
                label = batch.labels[b, d.start:d.stop].tolist()
                tokens = examples[d.example_id].tokens.tolist()
                start = max(d.offset, 1)
                assert label[-1] == EOS and label[:-1] == tokens[start:start + len(label) - 1]
                targets += len(label) - 1
    assert targets == sum(lengths)


def test_rows_of_one_full_piece_fill_both_sides_exactly():
    c = compiler()
    cfg = BatchConfig(seq_len=64, rows=1, buffer=4)
    assert c.capacity(cfg) == 63 and c.widths(cfg) == (64, 64)
    cost = c.piece_cost(cfg)
    assert cost(63) == 63 and all(cost(n) <= cost(n + 1) for n in range(63))
    batches = list(RowStream(corpus([63 * 5]), cfg, pad_id=PAD, seed=0, repeat=False,
                             compiler=c))
    middle = [int((b.segment_ids > 0).sum()) for b in batches
              if 0 < b.segments[0][0].offset and len(b.segments[0]) == 1
              and b.segments[0][0].offset + 63 < 63 * 5]
    assert middle and set(middle) == {64}


def test_without_the_charges_a_row_of_short_pieces_overflows():
    """Negative control for the charges: six 10-token middle pieces of one document (no
    BOS, no EOS of their own) fit the capacity by length (60 <= 63), but each adds an
    EOS (encoder) and a BOS (decoder): 66 columns. Charged, they cost 66 > 63, so the
    planner never puts them in one row."""
    c = compiler()
    cfg = BatchConfig(seq_len=64, rows=1, buffer=32)
    examples = corpus([200])
    row = [Piece(0, 1 + 10 * k, 10, k + 1) for k in range(6)]
    assert sum(p.length for p in row) <= c.capacity(cfg)
    with pytest.raises(BatchInvariantError, match="more than the 64 columns"):
        c.compile([row], examples, cfg, pad_id=PAD, weighted=False)
    assert sum(c.piece_cost(cfg)(p.length) for p in row) > c.capacity(cfg)
    c.compile([row[:5]], examples, cfg, pad_id=PAD, weighted=False)  # 55 columns fit


def test_held_out_rows_score_every_piece_once():
    assert held_out_pieces(compiler(), corpus([300, 4, 60]), VOCAB) >= 3


# --------------------------------------------------------------------------- addressing


def noise_by_piece(batches) -> dict:
    return sides_by_piece(batches, labels=False)


def test_a_pieces_noise_is_the_same_in_any_row_rank_or_resume():
    """R9, S5: packing, sharding and resume never change a compiled piece."""
    assert_same_in_any_row_rank_or_resume(
        corpus([30, 5, 140, 17, 60, 8, 22, 95, 3, 44]),
        compiler(seed=9, config=BartConfig(noise=ALL)), seed=9,
        fields=("source.input_ids", "labels"), by_piece=noise_by_piece)


def test_the_generator_is_addressed_by_seed_stream_epoch_example_and_piece():
    a = piece_generator(1, 2, 3, 4).random(4).tolist()
    assert a == np.random.default_rng([1, BART_STREAM, 2, 3, 4]).random(4).tolist()
    assert_another_seed_or_epoch_draws_anew(
        lambda seed, example, piece: compiler(seed=seed).noise_piece(example, piece)
        .inputs.tolist(), corpus([200])[0])


# --------------------------------------------------------------------------- wrong variants


def rotation_off_by_one(x, draws):
    """Wrong on purpose: the drawn token ends the piece instead of starting it."""
    if not x:
        return []
    start = draws.integers(len(x)) + 1
    return x[start:] + x[:start]


@pytest.mark.parametrize("name, patched, wrong", [
    # wrong on purpose: fairseq-like, every zero-length span kept (no cap)
    ("text_infilling", "span_lengths", ref.uncapped_lengths),
    ("document_rotation", "document_rotation", rotation_off_by_one),
])
def test_negative_control_a_reference_with_one_difference_disagrees(monkeypatch, name, patched,
                                                                    wrong):
    """The comparison can fail: the oracle with one deliberate difference (its function
    ``patched`` replaced by ``wrong``) disagrees with the compiler on some of the same
    pieces the true oracle matches."""
    config = BartConfig(noise=(name,), text_infilling_rate=0.3, poisson_lambda=0.3)
    examples = corpus([40] * 30)
    pieces = [(e, Piece(0, 0, len(e), 0)) for e in examples]
    assert all(compiler(0, config).noise_piece(e, p).inputs.tolist() ==
               reference_piece(config, e, p, 0) for e, p in pieces)
    monkeypatch.setattr(ref, patched, wrong)
    disagree = sum(compiler(0, config).noise_piece(e, p).inputs.tolist() !=
                   reference_piece(config, e, p, 0) for e, p in pieces)
    assert disagree > 0


class NoShift(NoShiftMixin, BartCompiler):
    """Wrong: the decoder reads the target itself (no start token, no shift)."""


class NoisedTarget(BartCompiler):
    """Wrong: the decoder is asked for the noised piece, not the original."""

    def noise_piece(self, example, piece):
        item = super().noise_piece(example, piece)
        return type(item)(item.example, item.piece, item.inputs, item.inputs)


@pytest.mark.parametrize("kind, seen", [(NoShift, "not the BOS start token"),
                                        (NoisedTarget, "the <mask> token")])
def test_wrong_variants_are_caught(kind, seen):
    examples = corpus([40, 90, 12, 25, 7])
    cfg = BatchConfig(seq_len=48, rows=2, buffer=4, check_invariants=False)
    c = kind(BartConfig(), seed=5, bos_id=BOS, eos_id=EOS, mask_id=MASK)
    batch = first_batch(examples, Recording(c), cfg, 5)
    assert actual_of(batch) != oracle_of(batch, examples, 48, 5, BartConfig())
    with pytest.raises(BatchInvariantError, match=seen):
        c.check(batch, VOCAB, cfg)


def test_r7_refuses_batches_that_break_the_bart_rows():
    assert_r7_refuses_broken_rows(compiler(), corpus([40, 90]), VOCAB, unpaired=False)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kwargs, message", [
    ({"noise": ()}, "leaves nothing to reconstruct"),
    ({"noise": ("token_masking", "text_infilling"), "token_masking_rate": 0.0,
      "text_infilling_rate": 0.0}, "leaves nothing to reconstruct"),
    ({"noise": ("token_deletion",), "token_deletion_rate": 0.0}, "bart.token_deletion_rate = 0"),
    ({"noise": ("sentence_shuffle",)}, "'sentence_shuffle', which is not a noising function"),
    ({"noise": ("token_masking", "token_masking")}, "lists 'token_masking' twice"),
    ({"token_masking_rate": 1.5}, "bart.token_masking_rate must be in \\[0, 1\\]"),
    ({"token_deletion_rate": -0.1}, "bart.token_deletion_rate must be in \\[0, 1\\]"),
    ({"text_infilling_rate": 2.0}, "bart.text_infilling_rate must be in \\[0, 1\\]"),
    ({"poisson_lambda": 0.0}, "bart.poisson_lambda must be > 0"),
    ({"poisson_lambda": float("nan")}, "bart.poisson_lambda must be a finite number"),
])
def test_settings_that_noise_nothing_or_are_out_of_range_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        BartConfig(**kwargs)


def test_a_rate_of_zero_is_accepted_beside_a_function_without_a_rate():
    BartConfig(noise=("sentence_permutation", "text_infilling"), text_infilling_rate=0.0)
    BartConfig(noise=("token_masking", "document_rotation"), token_masking_rate=0.0)


def test_a_row_too_short_is_refused():
    with pytest.raises(ConfigError, match="too short for BART denoising"):
        row_shape(2)
    with pytest.raises(ConfigError, match="too short for BART denoising"):
        compiler().capacity(BatchConfig(seq_len=2))
    assert row_shape(3) == (2, 3, 3)


def test_every_function_is_in_the_reference():
    assert set(NOISE_FUNCTIONS) == set(ALL)
    for name in NOISE_FUNCTIONS:
        assert callable(getattr(ref, name))
