"""R6: the rendered rows show the shift, the segments and the visible spans; a check
that reads only the rendered text catches a missing shift (negative control)."""

from __future__ import annotations

import re

import pytest
from rows_reference import WRONG_COMPILERS

from exactstep.data.documents import Document
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import encode_documents
from exactstep.rows.inspect import render_report, render_rows
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

TOK = ByteTokenizer()
LINE = re.compile(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\S+)\s+→ (\S+)\s+([01])\s+(.*)$")


def batch_and_examples(**policy):
    docs = [Document("a", "ab"), Document("b", "c d\n"), Document("c", "xyz")]
    examples = encode_documents(docs, TOK)
    stream = RowStream(
        examples,
        BatchConfig(seq_len=9, rows=2, **policy),
        pad_id=TOK.pad_id,
        seed=0,
        repeat=False,
        shuffle=False,
    )
    return next(iter(stream)), examples, stream


def parsed(text: str) -> list[tuple]:
    return [m.groups() for line in text.splitlines() if (m := LINE.match(line))]


def assert_rendered_shift(text: str) -> None:
    """From the text alone: each owned target is the next column's input in the same
    segment, spans are causal within the segment, padding owns nothing."""
    cols = parsed(text)
    assert cols
    for (col, seg, _, _, target, own, visible), nxt in zip(cols, cols[1:] + [None], strict=True):
        if seg == "0":
            assert own == "0" and visible == "none (padding)"
            continue
        first, last = map(int, re.match(r"cols (\d+)\.\.(\d+)", visible).groups())
        assert last == int(col) and first <= int(col)
        if own == "1":
            assert nxt is not None and nxt[1] == seg and nxt[3] == target, f"column {col}"


def test_rendered_rows_show_the_shift_and_spans() -> None:
    batch, _, _ = batch_and_examples()
    text = render_rows(batch, TOK, range(0, 2))
    assert "row 0:" in text and "row 1:" in text
    assert_rendered_shift(text)
    cols = parsed(text)
    assert cols[0][3:6] == ("<bos>", "c", "1")
    assert ("␣", "d") in [(c[3], c[4]) for c in cols]
    assert "segment 1: example 1 piece 0 tokens 0..5 at cols 0..5" in text


@pytest.mark.parametrize("name", ["no shift", "double shift", "cross-document target"])
def test_rendered_check_catches_wrong_rows(name: str) -> None:
    batch, examples, _ = batch_and_examples()
    rows = [
        [Piece(s.example_id, s.offset, s.length, s.piece) for s in row] for row in batch.segments
    ]
    wrong = WRONG_COMPILERS[name](rows, examples, seq_len=9, pad_id=TOK.pad_id)
    with pytest.raises(AssertionError):
        assert_rendered_shift(render_rows(wrong, TOK, range(0, 2)))


def test_rows_outside_the_batch_are_reported() -> None:
    batch, _, stream = batch_and_examples()
    assert "no rows" in render_rows(batch, TOK, range(5, 7))
    text = render_report(stream.report())
    assert "efficiency" in text and "split_targets_lost" in text
