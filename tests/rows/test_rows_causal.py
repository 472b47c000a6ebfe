"""R1-R3 (and the shift of target ownership, R5) on small hand-made documents.

Each exact expectation is written out by hand; each check is also run on a
deliberately wrong compiler (negative control) and must fail there.
"""

from __future__ import annotations

import pytest
import torch
from rows_reference import WRONG_COMPILERS, assert_causal_rows, text_example

from exactstep.data.documents import Document
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import encode_documents
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

TOK = ByteTokenizer()
BOS, EOS, PAD = TOK.bos_id, TOK.eos_id, TOK.pad_id
X = IGNORE_INDEX


def first_batch(docs: list[str], seq_len: int, rows: int = 1, **policy):
    examples = encode_documents([Document(f"d{i}", t) for i, t in enumerate(docs)], TOK)
    cfg = BatchConfig(seq_len=seq_len, rows=rows, **policy)
    stream = RowStream(
        examples, cfg, pad_id=PAD, seed=0, repeat=False, shuffle=False, vocab_size=TOK.vocab_size
    )
    return next(iter(stream)), examples


# "ab" -> [BOS a b EOS] (4 tokens), "cde" -> [BOS c d e EOS] (5 tokens).
# Best-fit decreasing puts the longer document first; one pad slot is left.
A, B, C, D, E = (ord(ch) for ch in "abcde")
HAND_INPUTS = [BOS, C, D, E, EOS, BOS, A, B, EOS, PAD]
HAND_LABELS_IGNORE = [C, D, E, EOS, X, A, B, EOS, X, X]
HAND_LABELS_KEEP = [C, D, E, EOS, BOS, A, B, EOS, X, X]
HAND_POSITIONS_RESET = [0, 1, 2, 3, 4, 0, 1, 2, 3, 0]
HAND_POSITIONS_CONTINUE = [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]
HAND_SEGMENTS = [1, 1, 1, 1, 1, 2, 2, 2, 2, 0]


@pytest.mark.parametrize("boundary", ["ignore", "keep"])
@pytest.mark.parametrize("positions", ["reset", "continue"])
def test_two_packed_documents_exact_rows(boundary: str, positions: str) -> None:
    """R1 shift once, R3 boundary and position policies, padding only at the end."""
    batch, _ = first_batch(["ab", "cde"], seq_len=10, boundary=boundary, positions=positions)
    assert batch.input_ids.tolist() == [HAND_INPUTS]
    labels = HAND_LABELS_IGNORE if boundary == "ignore" else HAND_LABELS_KEEP
    assert batch.labels.tolist() == [labels]
    positions_want = HAND_POSITIONS_RESET if positions == "reset" else HAND_POSITIONS_CONTINUE
    assert batch.position_ids.tolist() == [positions_want]
    assert batch.segment_ids.tolist() == [HAND_SEGMENTS]
    assert batch.shift_owner == "collator"
    addresses = [(s.example_id, s.piece, s.offset, s.start, s.length) for s in batch.segments[0]]
    assert addresses == [(1, 0, 0, 0, 5), (0, 0, 0, 5, 4)]


def test_hand_expectation_rejects_wrong_compilers() -> None:
    """Negative control: the hand-written rows differ from every wrong compiler's."""
    _, examples = first_batch(["ab", "cde"], seq_len=10)
    rows = [[Piece(1, 0, 5, 0), Piece(0, 0, 4, 0)]]
    right = compile_causal_batch(rows, examples, seq_len=10, pad_id=PAD)
    assert right.labels.tolist() == [HAND_LABELS_IGNORE]
    for name, wrong in WRONG_COMPILERS.items():
        if name == "ownership unshifted":
            continue  # identical for text, where every token but BOS is owned
        bad = wrong(rows, examples, seq_len=10, pad_id=PAD)
        same = (
            bad.labels.tolist() == [HAND_LABELS_IGNORE]
            and bad.position_ids.tolist() == [HAND_POSITIONS_RESET]
            and bad.segment_ids.tolist() == [HAND_SEGMENTS]
        )
        assert not same, name


@pytest.mark.parametrize("boundary", ["ignore", "keep"])
@pytest.mark.parametrize("positions", ["reset", "continue"])
def test_reference_check_accepts_compiler(boundary: str, positions: str) -> None:
    docs = ["ab", "cde", "hello", "x", "packing rows"]
    examples = encode_documents([Document(f"d{i}", t) for i, t in enumerate(docs)], TOK)
    cfg = BatchConfig(seq_len=12, rows=2, boundary=boundary, positions=positions)
    stream = RowStream(examples, cfg, pad_id=PAD, seed=3, repeat=False, vocab_size=TOK.vocab_size)
    for batch in stream:
        assert_causal_rows(batch, examples, boundary, positions, PAD)


@pytest.mark.parametrize("name", sorted(WRONG_COMPILERS))
def test_reference_check_rejects_wrong_compiler(name: str) -> None:
    """Negative controls for the reference check (R1, R2, R3, R5)."""
    prompt_then_answer = text_example(
        0, [BOS, 1, 2, 3, 4, 5, EOS], [False, False, False, True, True, True, True]
    )
    plain = text_example(1, [BOS, 7, 8, EOS])
    examples = [prompt_then_answer, plain]
    rows = [[Piece(0, 0, 7, 0), Piece(1, 0, 4, 0)]]
    wrong = WRONG_COMPILERS[name](rows, examples, seq_len=12, pad_id=PAD)
    with pytest.raises(AssertionError):
        assert_causal_rows(wrong, examples, "ignore", "reset", PAD)
    right = compile_causal_batch(rows, examples, seq_len=12, pad_id=PAD)
    assert_causal_rows(right, examples, "ignore", "reset", PAD)


def test_ownership_is_shifted_and_never_feeds_visibility() -> None:
    """R5/R2: the row holding the last prompt token predicts the first answer token and
    owns its loss; unowned prompt rows stay in the segment (visible to later rows)."""
    owned = [False, False, False, True, True, True, True]
    prompt_then_answer = text_example(0, [BOS, 1, 2, 3, 4, 5, EOS], owned)
    unowned_copy = text_example(0, [BOS, 1, 2, 3, 4, 5, EOS])
    rows = [[Piece(0, 0, 7, 0)]]
    batch = compile_causal_batch(rows, [prompt_then_answer], seq_len=8, pad_id=PAD)
    assert batch.labels.tolist() == [[X, X, 3, 4, 5, EOS, X, X]]
    plain = compile_causal_batch(rows, [unowned_copy], seq_len=8, pad_id=PAD)
    assert torch.equal(batch.segment_ids, plain.segment_ids)
    assert torch.equal(batch.position_ids, plain.position_ids)
    assert torch.equal(batch.input_ids, plain.input_ids)
    wrong = WRONG_COMPILERS["ownership unshifted"](
        rows, [prompt_then_answer], seq_len=8, pad_id=PAD
    )
    assert wrong.labels.tolist() != batch.labels.tolist()


def test_split_pieces_are_new_segments_and_lose_the_cut_target() -> None:
    """R4 split: the piece's first token is not a target of the previous piece."""
    example = text_example(0, [BOS, 10, 11, 12, 13, 14, EOS])  # 7 tokens
    cfg = BatchConfig(seq_len=3, rows=3, overlong="split")
    stream = RowStream([example], cfg, pad_id=PAD, seed=0, repeat=False, shuffle=False)
    batch = next(iter(stream))
    assert batch.input_ids.tolist() == [[BOS, 10, 11], [12, 13, 14], [EOS, PAD, PAD]]
    assert batch.labels.tolist() == [[10, 11, X], [13, 14, X], [X, X, X]]
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 1, 2], [0, 0, 0]]
    assert [s[0].piece for s in batch.segments] == [0, 1, 2]
    assert [s[0].offset for s in batch.segments] == [0, 3, 6]
    report = stream.report()
    assert report["split_documents"] == 1 and report["split_pieces"] == 3
    assert report["split_targets_lost"] == 2  # tokens 12 and EOS at the two cuts
    assert report["supervised_rows"] == report["targets"] - report["split_targets_lost"] == 4


def test_truncate_and_drop_are_counted() -> None:
    long = text_example(0, [BOS, 10, 11, 12, 13, 14, EOS])
    short = text_example(1, [BOS, 20, EOS])
    truncated = RowStream(
        [long, short],
        BatchConfig(seq_len=4, rows=4, overlong="truncate"),
        pad_id=PAD,
        seed=0,
        repeat=False,
    )
    batch = next(iter(truncated))
    report = truncated.report()
    assert report["truncated_documents"] == 1 and report["truncated_tokens"] == 3
    assert report["truncated_targets_lost"] == 3
    assert report["supervised_rows"] == batch.num_targets() == 3 + 2
    dropped = RowStream(
        [long, short],
        BatchConfig(seq_len=4, rows=4, overlong="drop"),
        pad_id=PAD,
        seed=0,
        repeat=False,
    )
    batch = next(iter(dropped))
    assert batch.input_ids.tolist() == [[BOS, 20, EOS, PAD]]
    report = dropped.report()
    assert report["dropped_documents"] == 1 and report["dropped_tokens"] == 7
    assert report["dropped_targets_lost"] == 6
    assert report["supervised_rows"] == report["targets"] - 6 == 2
