"""The encoder-decoder compiler (R1, R2, R6-R8) against a plain-Python oracle.

The oracle (``families.encdec.reference``) and the literal rows below are written from
the Annotated Transformer's definition: decoder input ``tgt[:-1]``, scored
``tgt[1:]``, ``ntokens`` the non-pad targets, the source padded with its own pad id.
Each check is also run on a deliberately wrong compiler, which it must catch.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.data.pairs import Pair
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import BatchInvariantError, DataError
from exactstep.families.encdec.compiler import (
    EncDecCompiler,
    PairPiece,
    compile_pair_batch,
    encode_pairs,
)
from exactstep.families.encdec.reference import expected_pair_rows
from exactstep.model.config import ModelConfig
from exactstep.model.encdec import EncoderDecoder
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, SourceSide
from exactstep.rows.config import BatchConfig
from exactstep.rows.packing import PackPlanner, Piece
from exactstep.rows.stream import RowStream

TOK = ByteTokenizer()
BOS, EOS, PAD = 256, 257, 258  # the byte tokenizer's ids, written out
V = 259


def b(text: str) -> list[int]:
    return list(text.encode())


def compiler(source_len: int, source_pad_id: int = PAD) -> EncDecCompiler:
    return EncDecCompiler(source_len=source_len, pad_id=PAD, source_pad_id=source_pad_id)


def compile_rows(rows, examples, seq_len, source_len, source_pad_id=PAD, positions="reset"):
    cfg = BatchConfig(seq_len=seq_len, rows=len(rows), positions=positions)
    c = compiler(source_len, source_pad_id)
    batch = c.compile(rows, examples, cfg, pad_id=PAD, weighted=False)
    return batch, c, cfg


def whole(example) -> Piece:
    return Piece(example=example.example_id, offset=0, length=len(example), piece=0)


def as_lists(batch: Batch) -> dict[str, list]:
    s = batch.source
    return {
        "input_ids": batch.input_ids.tolist(), "labels": batch.labels.tolist(),
        "position_ids": batch.position_ids.tolist(), "segment_ids": batch.segment_ids.tolist(),
        "source_ids": s.input_ids.tolist(), "source_position_ids": s.position_ids.tolist(),
        "source_segment_ids": s.segment_ids.tolist(),
        "segments": [[(g.example_id, g.start, g.length) for g in row] for row in batch.segments],
        "source_segments": [[(g.example_id, g.start, g.length) for g in row]
                            for row in s.segments],
        "ntokens": [batch.num_targets()],
    }


def oracle(batch_rows, examples, seq_len, source_len, source_pad_id=PAD, positions="reset"):
    """The oracle's batch for the planner's rows (pairs read from the examples)."""
    rows = [[(p.example, examples[p.example].source.tolist(), examples[p.example].tokens.tolist())
             for p in row] for row in batch_rows]
    return expected_pair_rows(rows, seq_len=seq_len, source_len=source_len, pad_id=PAD,
                              source_pad_id=source_pad_id, positions=positions)


PAIRS = [Pair("12", "twelve"), Pair("7", "seven"), Pair("305", "three hundred five")]


def test_hand_compiled_pairs_equal_the_compiler_exactly():
    examples, report = encode_pairs(PAIRS, TOK, seq_len=24, source_len=8, overlong="split")
    assert report.kept == 3
    rows = [[whole(examples[0]), whole(examples[1])], [whole(examples[2])]]
    batch, c, cfg = compile_rows(rows, examples, 24, 8)
    got = as_lists(batch)
    # row 0 by hand: "twelve" (7 decoder columns) then "seven" (6), sources "12" and "7"
    assert got["input_ids"][0] == [BOS, *b("twelve"), BOS, *b("seven")] + [PAD] * 11
    assert got["labels"][0] == [*b("twelve"), EOS, *b("seven"), EOS] + [IGNORE_INDEX] * 11
    assert got["position_ids"][0] == [*range(7), *range(6)] + [0] * 11
    assert got["segment_ids"][0] == [1] * 7 + [2] * 6 + [0] * 11
    assert got["source_ids"][0] == [*b("12"), EOS, *b("7"), EOS, PAD, PAD, PAD]
    assert got["source_position_ids"][0] == [0, 1, 2, 0, 1, 0, 0, 0]
    assert got["source_segment_ids"][0] == [1, 1, 1, 2, 2, 0, 0, 0]
    assert got["segments"][0] == [(0, 0, 7), (1, 7, 6)]
    assert got["source_segments"][0] == [(0, 0, 3), (1, 3, 2)]
    assert got["ntokens"] == [7 + 6 + 19]  # len(tgt) - 1 per pair
    assert got == oracle(rows, examples, 24, 8)
    c.check(batch, V, cfg)


# -- deliberately wrong compilers ------------------------------------------------------


def fed_whole_target(rows, examples, seq_len, source_len):
    """WRONG: the decoder is fed ``tgt`` (EOS included) instead of ``tgt[:-1]``, with
    ``tgt[1:]`` scored on the first columns (the last column is left without target)."""
    batch, _, _ = compile_rows(rows, examples, seq_len, source_len)
    ids = torch.full_like(batch.input_ids, PAD)
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    seg = torch.zeros_like(batch.segment_ids)
    pos = torch.zeros_like(batch.position_ids)
    segments = []
    for r, row in enumerate(rows):
        col, out = 0, []
        for s, p in enumerate(row, start=1):
            tgt = examples[p.example].tokens.tolist()
            n = len(tgt)
            ids[r, col:col + n] = torch.tensor(tgt)
            labels[r, col:col + n - 1] = torch.tensor(tgt[1:])
            seg[r, col:col + n] = s
            pos[r, col:col + n] = torch.arange(n)
            out.append(Segment(p.example, 0, 0, col, n))
            col += n
        segments.append(tuple(out))
    return replace(batch, input_ids=ids, labels=labels, segment_ids=seg, position_ids=pos,
                   segments=tuple(segments))


def unshifted(rows, examples, seq_len, source_len):
    """WRONG: labels equal the decoder inputs (the shift is missing, R1)."""
    batch, _, _ = compile_rows(rows, examples, seq_len, source_len)
    return replace(batch, labels=torch.where(batch.segment_ids > 0, batch.input_ids,
                                             IGNORE_INDEX))


def leaky_source_padding(rows, examples, seq_len, source_len, source_pad_id=PAD):
    """WRONG: source padding joins its row's last segment (so it would be attended)."""
    batch, _, _ = compile_rows(rows, examples, seq_len, source_len, source_pad_id)
    s = batch.source
    seg = s.segment_ids.clone()
    segments = []
    for r, row in enumerate(s.segments):
        last = row[-1]
        seg[r, last.stop:] = len(row)
        segments.append(row[:-1] + (last._replace(length=source_len - last.start),))
    return replace(batch, source=SourceSide(s.input_ids, s.position_ids, seg, tuple(segments)))


@pytest.mark.parametrize("wrong,message", [
    (fed_whole_target, "has no target"),
    (unshifted, "shift is missing or doubled"),
])
def test_wrong_decoder_sides_fail_the_oracle_and_the_r7_check(wrong, message):
    examples, _ = encode_pairs(PAIRS, TOK, seq_len=24, source_len=8, overlong="split")
    rows = [[whole(examples[0]), whole(examples[1])], [whole(examples[2])]]
    batch = wrong(rows, examples, 24, 8)
    assert as_lists(batch) != oracle(rows, examples, 24, 8)
    with pytest.raises(BatchInvariantError, match=message):
        compiler(8).check(batch, V, BatchConfig(seq_len=24, rows=2))


def test_leaky_source_padding_fails_the_oracle_and_the_r7_check():
    examples, _ = encode_pairs(PAIRS, TOK, seq_len=24, source_len=8, overlong="split")
    rows = [[whole(examples[0]), whole(examples[1])], [whole(examples[2])]]
    batch = leaky_source_padding(rows, examples, 24, 8)
    assert as_lists(batch) != oracle(rows, examples, 24, 8)
    broken = replace(batch, source=replace(batch.source, segments=compile_rows(
        rows, examples, 24, 8)[0].source.segments))
    with pytest.raises(BatchInvariantError, match="source.segment_ids disagree"):
        compiler(8).check(broken, V, BatchConfig(seq_len=24, rows=2))


def test_r7_refuses_a_missing_or_mispaired_encoder_side_and_a_pad_target():
    examples, _ = encode_pairs(PAIRS, TOK, seq_len=24, source_len=8, overlong="split")
    rows = [[whole(examples[0]), whole(examples[1])], [whole(examples[2])]]
    batch, c, cfg = compile_rows(rows, examples, 24, 8)
    with pytest.raises(BatchInvariantError, match="no encoder side"):
        c.check(replace(batch, source=None), V, cfg)
    swapped = tuple(row[::-1] for row in batch.source.segments)
    with pytest.raises(BatchInvariantError, match="do not pair up"):
        c.check(replace(batch, source=replace(batch.source, segments=swapped)), V, cfg)
    labels = batch.labels.clone()
    labels[1, 3] = PAD
    ids = batch.input_ids.clone()
    ids[1, 4] = PAD  # keep the shift consistent so only the pad target is wrong
    with pytest.raises(BatchInvariantError, match="target is the pad id"):
        c.check(replace(batch, labels=labels, input_ids=ids), V, cfg)
    with pytest.raises(BatchInvariantError, match=r"source.input_ids has shape \(2, 8\)"):
        compiler(9).check(batch, V, cfg)


# -- distinct source and target pad ids ------------------------------------------------


def run_model(batch: Batch) -> torch.Tensor:
    m = EncoderDecoder(ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32), V,
                       generator=torch.Generator().manual_seed(0))
    return m(batch).detach()


def test_a_distinct_source_pad_id_is_never_scored_and_never_attended():
    examples, _ = encode_pairs(PAIRS, TOK, seq_len=24, source_len=8, overlong="split")
    rows = [[whole(examples[0]), whole(examples[1])], [whole(examples[2])]]
    same, c, cfg = compile_rows(rows, examples, 24, 8, source_pad_id=PAD)
    other, c5, _ = compile_rows(rows, examples, 24, 8, source_pad_id=5)
    c5.check(other, V, cfg)
    padding = other.source.segment_ids == 0
    assert bool(padding.any()) and bool((other.source.input_ids[padding] == 5).all())
    assert as_lists(other) == oracle(rows, examples, 24, 8, source_pad_id=5)
    supervised = other.labels[other.labels != IGNORE_INDEX]
    assert not bool((supervised == 5).any()) and not bool((supervised == PAD).any())
    assert torch.equal(same.labels, other.labels)  # scored identically
    assert torch.equal(run_model(same), run_model(other))  # the pad id is never read
    # negative control: if source padding were attended, its id would change the output
    leaky_a = leaky_source_padding(rows, examples, 24, 8, PAD)
    leaky_b = leaky_source_padding(rows, examples, 24, 8, 5)
    assert not torch.allclose(run_model(leaky_a), run_model(leaky_b), rtol=0, atol=1e-6)


# -- the row budget, over-long pairs ---------------------------------------------------


def test_a_pair_is_never_split_and_each_policy_is_counted():
    long = [Pair("1", "x" * 30), Pair("9" * 12, "y"), Pair("2", "two")]
    with pytest.raises(DataError, match="cannot be split.*batch.overlong"):
        encode_pairs(long, TOK, seq_len=16, source_len=8, overlong="split")
    kept, report = encode_pairs(long, TOK, seq_len=16, source_len=8, overlong="drop")
    assert (report.kept, report.dropped) == (1, 2) and kept[0].tokens.tolist()[1:-1] == b("two")
    cut, report = encode_pairs(long, TOK, seq_len=16, source_len=8, overlong="truncate")
    assert report.truncated == 2
    assert [len(e.tokens) - 1 for e in cut][:2] == [16, 2]
    assert [len(e.source) for e in cut][:2] == [2, 8]
    assert all(len(e) <= 16 for e in cut)


pair_lists = st.lists(st.tuples(st.text("abcxyz 19", min_size=0, max_size=9),
                                st.text("abcxyz 19", min_size=0, max_size=14)),
                      min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(texts=pair_lists, seq_len=st.integers(16, 40), source_len=st.integers(11, 40),
       positions=st.sampled_from(["reset", "continue"]), seed=st.integers(0, 99))
def test_property_planner_rows_compile_to_the_oracle(texts, seq_len, source_len, positions,
                                                     seed):
    """Any pairs, any row budget: every row fits both sides, the batch is the oracle's,
    the R7 checks pass and ntokens is the pairs' target count."""
    pairs = [Pair(s or "0", t) for s, t in texts]
    examples, _ = encode_pairs(pairs, TOK, seq_len=seq_len, source_len=source_len,
                               overlong="drop")
    if not examples:
        return
    planner = PackPlanner(examples, seq_len=seq_len, buffer=4, overlong="split", seed=seed)
    rows = planner.next_rows(3)
    batch, c, cfg = compile_rows(rows, examples, seq_len, source_len, positions=positions)
    c.check(batch, V, cfg)
    assert as_lists(batch) == oracle(rows, examples, seq_len, source_len, positions=positions)
    assert batch.num_targets() == sum(len(examples[p.example].tokens) - 1
                                      for row in rows for p in row)


def test_stream_resumes_bitwise_and_reports_the_pairs():
    pairs = [Pair(str(i), "w" * (1 + i % 7)) for i in range(30)]
    examples, _ = encode_pairs(pairs, TOK, seq_len=20, source_len=8, overlong="split")
    cfg = BatchConfig(seq_len=20, rows=2, buffer=8)

    def stream():
        return RowStream(examples, cfg, pad_id=PAD, seed=1, vocab_size=V, compiler=compiler(8))

    a = stream()
    [a.next_batch() for _ in range(3)]
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(4)]
    b_ = stream()
    b_.load_state_dict(state)
    for x, y in zip(expected, [b_.next_batch() for _ in range(4)], strict=True):
        assert as_lists(x) == as_lists(y)


def test_compile_pair_batch_refuses_an_overflowing_row():
    piece = PairPiece(0, 0, np.arange(5), np.arange(4))
    with pytest.raises(DataError, match="overflows the row"):
        compile_pair_batch([[piece, piece]], seq_len=8, source_len=8, pad_id=PAD,
                           source_pad_id=PAD)


def test_weighted_pairs_carry_their_weight_on_every_decoder_column_l3():
    pairs = [Pair("1", "one", weight=2.5), Pair("2", "two", weight=0.5)]
    examples, _ = encode_pairs(pairs, TOK, seq_len=12, source_len=6, overlong="split")
    rows = [[whole(examples[0]), whole(examples[1])]]
    batch = compiler(6).compile(rows, examples, BatchConfig(seq_len=12, rows=1), pad_id=PAD,
                                weighted=True)
    assert batch.weights.tolist() == [[2.5] * 4 + [0.5] * 4 + [0.0] * 4]
    unweighted = [replace(examples[0], weight=None), examples[1]]
    with pytest.raises(DataError, match="has no \"weight\""):
        compiler(6).compile(rows, unweighted, BatchConfig(seq_len=12, rows=1), pad_id=PAD,
                            weighted=True)
