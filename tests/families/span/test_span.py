"""T5 span corruption (R8; R1, R3, R6, R7, S5): the compiler against a plain-Python
oracle, T5's length helper against T5's own formula, the defining invariant and the
counts as properties, addressed draws, rows that always fit and fill exactly where
T5 says they do, and wrong variants that these checks catch."""

from __future__ import annotations

import numpy as np
import pytest
from families.corruption_support import (
    BOS,
    EOS,
    PAD,
    NoShiftMixin,
    Recording,
    actual_of,
    assert_another_seed_or_epoch_draws_anew,
    assert_overflows_without_the_charges,
    assert_r7_refuses_broken_rows,
    assert_same_in_any_row_rank_or_resume,
    corpus,
    draw_rows,
    first_batch,
    held_out_pieces,
    oracle_rows,
    text,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from span_reference import (
    SPAN_STREAM,
    corrupt,
    counts,
    expected_sides,
    raw_of,
    reconstruct,
    t5_random_spans_helper,
)

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.span.compiler import SpanCompiler, noise_mask, piece_generator
from exactstep.families.span.config import SpanConfig
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

N_SENTINELS = 20
VOCAB = 259 + N_SENTINELS
SENTINELS = set(range(259, VOCAB))


def sentinel(k: int) -> int:
    """``extra_id_k``: T5's descending ids from the top of the vocabulary."""
    return VOCAB - 1 - k


def compiler(seed: int = 0, span: SpanConfig | None = None, *, top: int = VOCAB) -> SpanCompiler:
    """The compiler with ``extra_id_k = top - 1 - k``."""
    span = span or SpanConfig(sentinels=N_SENTINELS)
    return SpanCompiler(span, seed=seed, bos_id=BOS, eos_id=EOS,
                        sentinel_ids=[top - 1 - k for k in range(span.sentinels)])


def draws_of(seed: int, epoch: int, example_id: int, piece: int):
    rng = np.random.default_rng([seed, SPAN_STREAM, epoch, example_id, piece])
    return lambda n: rng.permutation(n).tolist()


# --------------------------------------------------------------------------- lengths


SETTINGS = [(512, 0.15, 3.0), (256, 0.15, 3.0), (114, 0.15, 3.0), (64, 0.15, 3.0),
            (128, 0.3, 2.0), (100, 0.5, 3.0), (200, 0.25, 5.0), (512, 0.15, 1.0),
            (48, 0.5, 1.0), (1024, 0.1, 8.0)]


def test_the_helper_is_t5s_and_pins_t5s_published_lengths():
    """T5 pretrains with inputs_length 512 (0.15, 3): 568 raw tokens, 114 targets."""
    assert SpanConfig().raw_length(512) == (568, 114)
    for inputs_length, density, mean in SETTINGS:
        span = SpanConfig(noise_density=density, mean_noise_span_length=mean)
        assert span.raw_length(inputs_length) == t5_random_spans_helper(
            inputs_length, density, mean), (inputs_length, density, mean)


def test_a_full_row_of_raw_tokens_corrupts_into_exactly_the_helpers_lengths():
    for inputs_length, density, mean in SETTINGS:
        span = SpanConfig(noise_density=density, mean_noise_span_length=mean)
        tokens_length, targets_length = t5_random_spans_helper(inputs_length, density, mean)
        if density == 0.5:  # T5 takes a token off both sides there
            assert span.corrupted_lengths(tokens_length)[1] <= targets_length
            continue
        assert span.corrupted_lengths(tokens_length) == (inputs_length, targets_length)


def test_counts_are_t5s_with_its_clamps():
    span = SpanConfig()
    assert [span.noise_counts(r) for r in (0, 1, 2, 3, 9, 10, 20, 100)] == [
        (0, 0), (0, 0), (1, 1), (1, 1), (1, 1), (2, 1), (3, 1), (15, 5)]
    assert SpanConfig(noise_density=0.5, mean_noise_span_length=1.0).noise_counts(3) == (2, 1)


# --------------------------------------------------------------------------- by hand


def test_a_hand_written_example():
    """``abcdefghij``: N = round(1.5) = 2 noise tokens in K = 1 span; the single span is
    the last two tokens whatever the draws (non-noise first, noise last)."""
    raw = [ord(c) for c in "abcdefghij"]
    example = Example(0, np.array([BOS, *raw, EOS], dtype=np.int64))
    piece = compiler().corrupt_piece(example, Piece(0, 0, len(example), 0))
    s0 = VOCAB - 1
    assert piece.inputs.tolist() == [*map(ord, "abcdefgh"), s0, EOS]
    assert piece.targets.tolist() == [s0, ord("i"), ord("j"), EOS]


def test_a_hand_written_mask_gives_t5s_two_sides():
    """``The cat sat`` with ``cat`` and ``t`` noised: T5's example shape."""
    raw = list(b"The cat sat")
    mask = [c in (4, 5, 6, 10) for c in range(len(raw))]
    inputs, targets = corrupt(raw, mask, sentinel, EOS)
    s0, s1 = sentinel(0), sentinel(1)
    assert inputs == [*b"The ", s0, *b" sa", s1, EOS]
    assert targets == [s0, *b"cat", s1, *b"t", EOS]
    from exactstep.families.span.compiler import corrupt as compiled_corrupt

    got = compiled_corrupt(np.array(raw), np.array(mask), np.array([s0, s1]), EOS)
    assert [g.tolist() for g in got] == [inputs, targets]


# --------------------------------------------------------------------------- the oracle


def oracle_of(batch, examples, seq_len, seed, span):
    rows, draws = oracle_rows(batch, examples, seed, draws_of)
    return expected_sides(rows, draws, seq_len=seq_len, noise_density=span.noise_density,
                          mean_noise_span_length=span.mean_noise_span_length,
                          sentinel=sentinel, bos=BOS, eos=EOS, pad=PAD)


@pytest.mark.parametrize("span", [SpanConfig(sentinels=N_SENTINELS),
                                  SpanConfig(noise_density=0.3, mean_noise_span_length=2.0,
                                             sentinels=N_SENTINELS)])
def test_the_compiler_equals_the_oracle(span):
    examples = corpus([3, 7, 20, 41, 150, 9, 1, 66, 12, 5, 33, 90])
    cfg = BatchConfig(seq_len=48, rows=3, buffer=6)
    stream = RowStream(examples, cfg, pad_id=PAD, seed=5, vocab_size=VOCAB,
                       compiler=Recording(compiler(seed=5, span=span)))
    packed = 0
    for _ in range(12):  # crosses an epoch boundary: the new epoch draws anew
        batch = stream.next_batch()
        packed += sum(len(s) > 1 for s in batch.segments)
        assert actual_of(batch) == oracle_of(batch, examples, 48, 5, span)
    assert packed >= 3  # rows that hold several pieces were compared too
    assert stream.planner.epoch >= 1


# --------------------------------------------------------------------------- properties


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=st.integers(0, 400), density=st.floats(0.02, 0.6), mean=st.floats(1.0, 8.0),
       seed=st.integers(0, 2**31), example_id=st.integers(0, 10**6))
def test_corruption_properties(r, density, mean, seed, example_id):
    """The defining invariant and every count, for any length and settings."""
    span = SpanConfig(noise_density=density, mean_noise_span_length=mean, sentinels=400)
    c = compiler(seed, span, top=10_000)  # sentinel ids well clear of the bytes
    rng = np.random.default_rng(example_id)
    example = text(example_id, r, rng)
    piece = c.corrupt_piece(example, Piece(0, 0, r + 2, 0))
    inputs, targets = piece.inputs.tolist(), piece.targets.tolist()
    sentinels = set(c.sentinels.tolist())
    raw = example.tokens[1:-1].tolist()
    assert reconstruct(inputs, targets, sentinels) == raw
    assert (len(inputs), len(targets)) == span.corrupted_lengths(r)
    n_noise, n_spans = counts(r, density, mean)
    in_sentinels = [t for t in inputs if t in sentinels]
    out_sentinels = [t for t in targets if t in sentinels]
    assert in_sentinels == [c.sentinels[k] for k in range(n_spans)]  # extra_id_0, 1, ... in order
    assert out_sentinels == [c.sentinels[k] for k in range(max(n_spans, min(r, 1)))]
    assert len(targets) - 1 - len(out_sentinels) == n_noise
    mask = noise_mask(r, span, piece_generator(seed, 0, example_id, 0))
    assert int(mask.sum()) == n_noise
    starts = [j for j in range(r) if mask[j] and (j == 0 or not mask[j - 1])]
    assert len(starts) == n_spans
    if r >= 2:  # non-noise first, noise last
        assert not mask[0] and mask[-1]


@st.composite
def stream_case(draw):
    lengths = draw(st.lists(st.integers(1, 200), min_size=1, max_size=14))
    seq_len = draw(st.integers(12, 80))
    span = SpanConfig(noise_density=draw(st.sampled_from([0.15, 0.3, 0.5])),
                      mean_noise_span_length=draw(st.sampled_from([1.0, 3.0])), sentinels=60)
    cfg = draw_rows(draw, seq_len)
    return lengths, cfg, span


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=stream_case())
def test_every_row_fits_both_sides_and_every_piece_reconstructs(case):
    """Whatever the pieces (many tiny ones included), the planner's charges keep both
    sides within their widths; each segment pair rebuilds its raw piece; R7 passes."""
    lengths, cfg, span = case
    vocab = 259 + span.sentinels
    try:
        c = compiler(1, span, top=vocab)
        c.capacity(cfg)
    except ConfigError:
        return  # a row too short for these settings is refused up front
    examples = corpus(lengths, seed=len(lengths))
    by_id = {e.example_id: e for e in examples}
    stream = RowStream(examples, cfg, pad_id=PAD, seed=2, repeat=False, vocab_size=vocab,
                       compiler=c)
    raw_tokens = 0
    for batch in stream:
        c.check(batch, vocab, cfg)
        enc_width, dec_width = c.widths(cfg)
        assert batch.source.shape[1] == enc_width and batch.shape[1] == dec_width
        for b, (dec, enc) in enumerate(zip(batch.segments, batch.source.segments, strict=True)):
            for d, e in zip(dec, enc, strict=True):
                inputs = batch.source.input_ids[b, e.start:e.stop].tolist()
                targets = batch.labels[b, d.start:d.stop].tolist()
                tokens = by_id[d.example_id].tokens.tolist()
                raw = reconstruct(inputs, targets, set(c.sentinels.tolist()))
                start = max(d.offset, 1)
                assert start + len(raw) <= len(tokens) - 1
                assert raw == tokens[start:start + len(raw)]
                raw_tokens += len(raw)
    assert raw_tokens == sum(lengths)  # every raw token once (split pieces do not overlap)


# --------------------------------------------------------------------------- exact fill


def test_rows_of_one_full_piece_fill_both_sides_exactly():
    """A long document splits into pieces of ``capacity`` raw tokens: each middle piece
    fills its row's encoder and decoder exactly (T5's guarantee)."""
    c = compiler()
    cfg = BatchConfig(seq_len=64, rows=1, buffer=4)
    capacity = c.capacity(cfg)
    assert capacity == 70 and c.widths(cfg) == (64, 14)
    examples = corpus([capacity * 5])
    batches = list(RowStream(examples, cfg, pad_id=PAD, seed=0, repeat=False, compiler=c))
    fills = [(int((b.source.segment_ids > 0).sum()), int((b.segment_ids > 0).sum()),
              b.segments[0][0].offset) for b in batches]
    middle = [(e, d) for e, d, offset in fills if 0 < offset and offset + capacity < 5 * capacity]
    assert middle and all(f == (64, 14) for f in middle)


def test_without_the_charges_a_row_of_short_pieces_overflows():
    """Negative control for the charges: planned by length alone, a row of short
    documents has more sentinels and EOS than the decoder side holds."""
    assert_overflows_without_the_charges(compiler(), corpus([8] * 20),
                                         BatchConfig(seq_len=64, rows=1, buffer=32),
                                         "more than the 14 columns")


# --------------------------------------------------------------------------- addressing


def test_an_examples_corruption_is_the_same_in_any_row_rank_or_resume():
    assert_same_in_any_row_rank_or_resume(
        corpus([30, 5, 140, 17, 60, 8, 22, 95, 3, 44]), compiler(seed=9), seed=9,
        fields=("input_ids", "labels", "source.input_ids"))


def test_another_seed_or_epoch_draws_another_corruption():
    assert_another_seed_or_epoch_draws_anew(
        lambda seed, example, piece: compiler(seed=seed).corrupt_piece(example, piece)
        .inputs.tolist(), corpus([200])[0])


# --------------------------------------------------------------------------- wrong variants


class NoSentinelTargets(SpanCompiler):
    """Wrong: the target is the noise spans alone, without sentinels."""

    def corrupt_piece(self, example, piece):
        item = super().corrupt_piece(example, piece)
        keep = ~np.isin(item.targets, self.sentinels)
        return type(item)(item.example, item.piece, item.inputs, item.targets[keep])


class ReusedSentinel(SpanCompiler):
    """Wrong: every span is marked with extra_id_0 on both sides."""

    def corrupt_piece(self, example, piece):
        item = super().corrupt_piece(example, piece)
        first = self.sentinels[0]
        fix = lambda a: np.where(np.isin(a, self.sentinels), first, a)  # noqa: E731
        return type(item)(item.example, item.piece, fix(item.inputs), fix(item.targets))


class NoShift(NoShiftMixin, SpanCompiler):
    """Wrong: the decoder reads the target itself (no start token, no shift)."""


def wrong(kind):
    span = SpanConfig(sentinels=N_SENTINELS)
    return kind(span, seed=5, bos_id=BOS, eos_id=EOS,
                sentinel_ids=[sentinel(k) for k in range(N_SENTINELS)])


@pytest.mark.parametrize("kind", [NoSentinelTargets, ReusedSentinel, NoShift])
def test_wrong_variants_are_caught(kind):
    """The oracle comparison catches all three; the defining invariant catches the
    target without sentinels and the reused sentinel; R7 catches the missing shift."""
    examples = corpus([40, 90, 12, 25, 7])
    cfg = BatchConfig(seq_len=48, rows=2, buffer=4, check_invariants=False)
    batch = first_batch(examples, Recording(wrong(kind)), cfg, 5)
    span = SpanConfig(sentinels=N_SENTINELS)
    assert actual_of(batch) != oracle_of(batch, examples, 48, 5, span)
    if kind is NoShift:
        with pytest.raises(BatchInvariantError, match="not the BOS start token"):
            wrong(kind).check(batch, VOCAB, cfg)
        return
    rebuilt = []
    for b, (dec, enc) in enumerate(zip(batch.segments, batch.source.segments, strict=True)):
        for d, e in zip(dec, enc, strict=True):
            try:
                rebuilt.append(reconstruct(batch.source.input_ids[b, e.start:e.stop].tolist(),
                                           batch.labels[b, d.start:d.stop].tolist(), SENTINELS))
            except (AssertionError, KeyError):
                rebuilt.append(None)
    originals = [raw_of(next(x for x in examples if x.example_id == d.example_id).tokens.tolist(),
                        d.offset, d.length) for row in batch.segments for d in row]
    assert any(r is None for r in rebuilt) or rebuilt != originals


def test_r7_refuses_batches_that_break_the_span_rows():
    assert_r7_refuses_broken_rows(compiler(), corpus([40, 90]), VOCAB)


def test_settings_out_of_range_or_too_small_are_refused():
    with pytest.raises(ConfigError, match="span.noise_density"):
        SpanConfig(noise_density=1.0)
    with pytest.raises(ConfigError, match="span.mean_noise_span_length"):
        SpanConfig(mean_noise_span_length=0.5)
    with pytest.raises(ConfigError, match="span.sentinels >= 5"):
        compiler(span=SpanConfig(sentinels=3)).capacity(BatchConfig(seq_len=100))
    with pytest.raises(ConfigError, match="too short for span corruption"):
        compiler().capacity(BatchConfig(seq_len=2))


def test_held_out_rows_score_every_piece_once():
    """eval_batches plans with the same charges: every held-out piece compiles."""
    assert held_out_pieces(compiler(), corpus([300, 4, 60]), VOCAB) >= 3
