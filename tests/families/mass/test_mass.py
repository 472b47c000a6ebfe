"""MASS (R9; R1, R3, R6, R7, S5): the compiler against a plain-Python oracle
(``mass_reference``) on hundreds of random corpora and row shapes, the edges (a
one-token and a two-token document, an empty one, a document split across rows,
fraction 1), addressed draws, the R7 checks, the section's refusals, and wrong
variants these checks catch (a fragment shifted by one, a decoder without the
shift)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
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
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mass_reference import IGNORE, PieceRef, Rule, expected_sides, fragment_length

from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families.mass.compiler import MASS_STREAM, MassCompiler
from exactstep.families.mass.config import MassConfig
from exactstep.rows.config import BatchConfig
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

MASK = 259
VOCAB = 260
CONTENT = tuple(range(256))


def compiler(seed: int = 0, mass: MassConfig | None = None) -> MassCompiler:
    return MassCompiler(mass or MassConfig(), seed=seed, bos_id=BOS, eos_id=EOS, mask_id=MASK,
                        content_ids=CONTENT)


def rule_of(mass: MassConfig) -> Rule:
    return Rule(fraction=mass.fraction, mask_rate=mass.mask_rate,
                random_rate=mass.random_rate, mask=MASK, bos=BOS, eos=EOS, pad=PAD,
                content=CONTENT)


def oracle_of(batch, mass: MassConfig, *, seed: int, seq_len: int, positions: str = "reset",
              shift: int = 0) -> dict[str, list[list[int]]]:
    rows = [[PieceRef(e.tokens.tolist(), p.offset, p.length, e.example_id, p.piece, p.epoch)
             for p, e in row] for row in batch.meta["pieces"]]
    return expected_sides(rows, rule_of(mass), seed=seed, seq_len=seq_len,
                          positions=positions, shift=shift)


def stream_of(examples, cfg: BatchConfig, c, *, seed: int, **kw) -> RowStream:
    return RowStream(examples, cfg, pad_id=PAD, seed=seed, vocab_size=VOCAB,
                     compiler=Recording(c, with_examples=True), **kw)


def agree(examples, cfg: BatchConfig, mass: MassConfig, *, seed: int, batches: int | None = None,
          shift: int = 0) -> tuple[int, int]:
    """Compile ``examples`` and compare every batch with the oracle; ``(pieces, split
    pieces)`` compared. ``batches=None``: one pass without repeats."""
    c = compiler(seed, mass)
    stream = stream_of(examples, cfg, c, seed=seed, repeat=batches is not None)
    seen = pieces = split = 0
    for batch in stream:
        c.check(batch, VOCAB, cfg)
        expected = oracle_of(batch, mass, seed=seed, seq_len=cfg.seq_len,
                             positions=cfg.positions, shift=shift)
        if shift:
            if actual_of(batch) != expected:
                return -1, -1
        else:
            assert actual_of(batch) == expected
        pieces += sum(len(r) for r in batch.segments)
        split += sum(s.piece > 0 for r in batch.segments for s in r)
        seen += 1
        if batches is not None and seen >= batches:
            break
    return pieces, split


# --------------------------------------------------------------------------- the oracle


@st.composite
def stream_case(draw):
    lengths = draw(st.lists(st.integers(0, 100), min_size=1, max_size=6))
    fraction = draw(st.sampled_from([0.5, 1.0, 0.15, 0.3, 0.7]) | st.floats(0.01, 1.0))
    mask_rate = draw(st.sampled_from([0.8, 0.0, 1.0, 0.5]))
    random_rate = draw(st.sampled_from([0.1, 0.0, 1.0 - mask_rate, (1.0 - mask_rate) / 2]))
    random_rate = min(random_rate, 1.0 - mask_rate)
    mass = MassConfig(fraction=fraction, mask_rate=mask_rate, random_rate=random_rate,
                      keep_rate=1.0 - mask_rate - random_rate)
    cfg = draw_rows(draw, draw(st.integers(2, 64)))
    return lengths, cfg, mass, draw(st.integers(0, 2**31))


@pytest.mark.slow  # about 15 s on a shared 2-core machine
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=stream_case())
def test_the_compiler_equals_the_oracle_r9(case):
    """Every tensor of every batch of a whole pass equals the oracle's, whatever the
    documents (empty, one token, longer than a row), the row shape, the positions and
    the section; R7 passes on each batch."""
    lengths, cfg, mass, seed = case
    examples = corpus(lengths, seed=len(lengths))
    agree(examples, cfg, mass, seed=seed)


def test_the_compiler_equals_the_oracle_across_epochs():
    """Packed rows of several pieces, an epoch boundary (the new epoch draws anew)."""
    examples = corpus([3, 7, 20, 41, 150, 9, 1, 66, 12, 5, 33, 90, 0, 2])
    cfg = BatchConfig(seq_len=48, rows=3, buffer=6)
    c = compiler(5)
    stream = stream_of(examples, cfg, c, seed=5)
    packed = 0
    for _ in range(14):
        batch = stream.next_batch()
        packed += sum(len(s) > 1 for s in batch.segments)
        assert actual_of(batch) == oracle_of(batch, MassConfig(), seed=5, seq_len=48)
    assert packed >= 3 and stream.planner.epoch >= 1


# --------------------------------------------------------------------------- edges


def one_piece(n: int, mass: MassConfig | None = None, seed: int = 3):
    """The batch of one document of ``n`` content tokens alone in a row of 64."""
    mass = mass or MassConfig()
    examples = corpus([n], seed=n)
    cfg = BatchConfig(seq_len=64, rows=1, buffer=1)
    c = compiler(seed, mass)
    batch = next(iter(stream_of(examples, cfg, c, seed=seed, repeat=False)))
    c.check(batch, VOCAB, cfg)
    assert actual_of(batch) == oracle_of(batch, mass, seed=seed, seq_len=64)
    return examples[0].tokens[1:-1].tolist(), batch


def test_a_one_token_document_is_masked_whole():
    raw, batch = one_piece(1)
    assert batch.source.input_ids[0, :2].tolist()[1] == EOS
    assert batch.labels[0, :2].tolist() == [raw[0], IGNORE]
    assert batch.input_ids[0, 0] == MASK and batch.position_ids[0, 0] == 0


def test_a_two_token_document_has_a_one_token_fragment():
    raw, batch = one_piece(2)
    assert fragment_length(2, 0.5) == 1
    (target,) = [t for t in batch.labels[0].tolist() if t != IGNORE]
    position = int(batch.position_ids[0, 0])
    assert target == raw[position] and batch.input_ids[0, 0] == MASK


def test_an_empty_document_has_one_unsupervised_decoder_column():
    _, batch = one_piece(0)
    assert batch.source.input_ids[0, 0] == EOS and int((batch.source.segment_ids > 0).sum()) == 1
    assert int((batch.segment_ids > 0).sum()) == 1 and batch.num_targets() == 0


def test_fraction_one_masks_the_whole_piece_and_predicts_it_in_order():
    mass = MassConfig(fraction=1.0, mask_rate=1.0, random_rate=0.0, keep_rate=0.0)
    raw, batch = one_piece(40, mass)
    assert batch.source.input_ids[0, :41].tolist() == [MASK] * 40 + [EOS]
    assert batch.labels[0, :40].tolist() == raw
    assert batch.input_ids[0, :40].tolist() == [MASK, *raw[:-1]]
    assert batch.position_ids[0, :40].tolist() == list(range(40))


def test_a_document_split_across_rows_has_a_fragment_in_each_piece():
    """A document five rows long: each row holds one piece of it, and each piece has its
    own fragment inside it (a fragment never crosses a row boundary); the oracle
    agrees on every row."""
    mass = MassConfig()
    examples = corpus([47 * 5])
    cfg = BatchConfig(seq_len=48, rows=1, buffer=2)
    pieces, split = agree(examples, cfg, mass, seed=1)
    assert pieces >= 5 and split >= 4
    c = compiler(1, mass)
    tokens = examples[0].tokens.tolist()
    for batch in RowStream(examples, cfg, pad_id=PAD, seed=1, repeat=False, compiler=c):
        (enc,), (dec,) = batch.source.segments[0], batch.segments[0]
        labels = batch.labels[0, dec.start:dec.stop].tolist()
        u = int(batch.position_ids[0, dec.start])
        start = max(dec.offset, 1)
        assert 0 <= u and u + len(labels) <= enc.length - 1
        assert labels == tokens[start + u:start + u + len(labels)]


def test_a_hand_checked_row_keeps_the_original_positions():
    """``continue`` positions: the second piece's fragment sits at its encoder columns."""
    examples = corpus([10, 10], seed=4)
    cfg = BatchConfig(seq_len=40, rows=1, buffer=4, positions="continue")
    c = compiler(0, MassConfig(mask_rate=1.0, random_rate=0.0, keep_rate=0.0))
    batch = next(iter(RowStream(examples, cfg, pad_id=PAD, seed=0, repeat=False, compiler=c)))
    enc_ids, positions = batch.source.input_ids[0].tolist(), batch.position_ids[0].tolist()
    for dec in batch.segments[0]:
        for col in range(dec.start, dec.stop):
            assert enc_ids[positions[col]] == MASK  # the masked column of that token
    assert len(batch.segments[0]) == 2 and all(d.length == 5 for d in batch.segments[0])


# --------------------------------------------------------------------------- replacement


def test_random_tokens_are_content_and_the_rates_are_honoured():
    mass = MassConfig(mask_rate=0.0, random_rate=1.0, keep_rate=0.0)
    c = MassCompiler(mass, seed=0, bos_id=BOS, eos_id=EOS, mask_id=MASK,
                     content_ids=range(100, 110))
    for i, example in enumerate(corpus([30, 60, 90])):
        item = c.mask_piece(example, Piece(i, 0, len(example), 0))
        shown = item.inputs[item.start:item.start + len(item.targets)]
        assert all(100 <= t < 110 for t in shown.tolist())
    keep = compiler(0, MassConfig(mask_rate=0.0, random_rate=0.0, keep_rate=1.0))
    example = corpus([50])[0]
    item = keep.mask_piece(example, Piece(0, 0, len(example), 0))
    assert item.inputs.tolist() == [*example.tokens[1:-1].tolist(), EOS]


def test_the_replacement_shares_follow_the_rates():
    c = compiler(0)
    counts = np.zeros(4, dtype=np.int64)
    for i, example in enumerate(corpus([200] * 30)):
        counts += np.bincount(c.mask_piece(example, Piece(i, 0, len(example), 0)).action,
                              minlength=4)
    shares = counts[1:] / counts.sum()  # 3000 fragment tokens
    assert abs(shares[0] - 0.8) < 0.03 and abs(shares[1] - 0.1) < 0.02


# --------------------------------------------------------------------------- addressing


def test_a_pieces_draws_are_the_same_in_any_row_rank_or_resume_s5():
    assert_same_in_any_row_rank_or_resume(
        corpus([30, 5, 140, 17, 60, 8, 22, 95, 3, 44]), compiler(9), seed=9,
        fields=("input_ids", "labels", "position_ids", "source.input_ids"))


def test_another_seed_or_epoch_draws_another_fragment():
    assert_another_seed_or_epoch_draws_anew(
        lambda seed, example, piece: compiler(seed).mask_piece(example, piece).inputs.tolist(),
        corpus([200])[0])
    assert MASS_STREAM == 0x4D415353


# --------------------------------------------------------------------------- wrong variants


def test_negative_control_an_oracle_with_the_fragment_shifted_disagrees():
    examples = corpus([60, 90, 120, 30])
    cfg = BatchConfig(seq_len=64, rows=2, buffer=4)
    assert agree(examples, cfg, MassConfig(), seed=2, shift=1) == (-1, -1)
    assert agree(examples, cfg, MassConfig(), seed=2)[0] >= 4  # the unshifted one agrees


class NoShift(NoShiftMixin, MassCompiler):
    """Wrong: the decoder reads the fragment itself (no start token, no shift)."""


class ResetDecoderPositions(MassCompiler):
    """Wrong: decoder positions restart at 0 (the fragment's positions are lost)."""

    def compile(self, rows, examples, cfg, *, pad_id, weighted):
        batch = super().compile(rows, examples, cfg, pad_id=pad_id, weighted=weighted)
        return replace(batch, position_ids=torch.zeros_like(batch.position_ids))


@pytest.mark.parametrize("kind, seen", [(NoShift, "not the <mask> start token"),
                                        (ResetDecoderPositions, "does not follow")])
def test_wrong_variants_are_caught_r7(kind, seen):
    examples = corpus([40, 90, 12, 25, 7])
    cfg = BatchConfig(seq_len=48, rows=2, buffer=4, check_invariants=False)
    wrong = kind(MassConfig(), seed=5, bos_id=BOS, eos_id=EOS, mask_id=MASK, content_ids=CONTENT)
    batch = first_batch(examples, Recording(wrong, with_examples=True), cfg, 5)
    assert actual_of(batch) != oracle_of(batch, MassConfig(), seed=5, seq_len=48)
    with pytest.raises(BatchInvariantError, match=seen):
        wrong.check(batch, VOCAB, cfg)


def test_r7_refuses_batches_that_break_mass_rows():
    assert_r7_refuses_broken_rows(compiler(), corpus([40, 90]), VOCAB, label_column=1,
                                  outside=False)


def test_without_the_charges_a_row_of_short_pieces_overflows():
    """Negative control for ``piece_cost``: planned by length alone, a row of short
    documents has more fragment columns than the decoder side holds (a fragment of a
    one-token document is one column, a tenth of a full row's is six)."""
    assert_overflows_without_the_charges(compiler(mass=MassConfig(fraction=0.1)),
                                         corpus([1] * 40),
                                         BatchConfig(seq_len=64, rows=1, buffer=32),
                                         "more than the 6 columns")


def test_held_out_rows_score_every_piece_once():
    assert held_out_pieces(compiler(), corpus([300, 4, 60, 0]), VOCAB) >= 4


# --------------------------------------------------------------------------- refusals


def test_rates_that_do_not_sum_to_one_are_refused():
    with pytest.raises(ConfigError, match=r"mass.mask_rate \+ mass.random_rate \+ "
                                          r"mass.keep_rate must sum to 1"):
        MassConfig(mask_rate=0.8, random_rate=0.1, keep_rate=0.2)
    MassConfig(mask_rate=0.7, random_rate=0.2, keep_rate=0.1)  # 0.7 + 0.2 + 0.1 != 1.0 exactly


def test_settings_out_of_range_are_refused():
    with pytest.raises(ConfigError, match="mass.fraction"):
        MassConfig(fraction=0.0)
    with pytest.raises(ConfigError, match="mass.fraction"):
        MassConfig(fraction=1.5)
    with pytest.raises(ConfigError, match="mass.random_rate"):
        MassConfig(mask_rate=0.9, random_rate=-0.1, keep_rate=0.2)
    with pytest.raises(ConfigError, match="mass.start"):
        MassConfig(start="fixed")


def test_a_row_that_cannot_hold_a_fragment_is_refused():
    """The decoder side is sized for a full row's fragment, so a fragment never outgrows
    its row; a row with no room for one content token and EOS is refused, by
    ``row_shape`` and, before it, by ``batch.seq_len``'s own range."""
    from exactstep.families.mass.config import row_shape

    with pytest.raises(ConfigError, match="batch.seq_len = 1 cannot hold a MASS fragment"):
        row_shape(MassConfig(), 1)
    with pytest.raises(ConfigError, match="batch.seq_len must be >= 2"):
        BatchConfig(seq_len=1)
    assert compiler().widths(BatchConfig(seq_len=2)) == (2, 1)
    assert row_shape(MassConfig(fraction=1.0), 128) == (127, 128, 127)
