"""R7: each invariant violation raises BatchInvariantError naming the example; the
valid batch the violations are made from passes (negative control for each check)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rows_reference import WRONG_COMPILERS, text_example

from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import BatchInvariantError
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.invariants import check_batch
from exactstep.rows.packing import Piece
from exactstep.rows.stream import RowStream

TOK = ByteTokenizer()
V, PAD, BOS, EOS = TOK.vocab_size, TOK.pad_id, TOK.bos_id, TOK.eos_id
EXAMPLES = [text_example(7, [BOS, 1, 2, 3, EOS]), text_example(9, [BOS, 4, 5, EOS])]
EXAMPLES_BY_INDEX = [EXAMPLES[0], EXAMPLES[1]]
ROWS = [[Piece(0, 0, 5, 0), Piece(1, 0, 4, 0)], [Piece(1, 0, 4, 0)]]


def valid_batch():
    return compile_causal_batch(ROWS, EXAMPLES_BY_INDEX, seq_len=10, pad_id=PAD)


def with_label(batch, b: int, i: int, value: int):
    labels = batch.labels.clone()
    labels[b, i] = value
    return replace(batch, labels=labels)


def with_input(batch, b: int, i: int, value: int):
    inputs = batch.input_ids.clone()
    inputs[b, i] = value
    return replace(batch, input_ids=inputs)


def test_valid_batch_passes() -> None:
    check_batch(valid_batch(), V, "ignore", next_token_targets=True)


@pytest.mark.parametrize(
    ("mutate", "names"),
    [
        (
            lambda b: with_label(b, 0, 1, V),
            ["row 0 column 1", "example 7", "outside the vocabulary"],
        ),
        (lambda b: with_label(b, 0, 6, -5), ["row 0 column 6", "example 9", "negative"]),
        (lambda b: with_input(b, 1, 2, V + 3), ["row 1 column 2", "example 9", "input id"]),
        (lambda b: with_input(b, 1, 2, -1), ["row 1 column 2", "example 9"]),
        (lambda b: with_label(b, 0, 4, BOS), ["row 0 column 4", "example 7", "crosses"]),
        (lambda b: with_label(b, 1, 3, 1), ["row 1 column 3", "example 9", "crosses"]),
        (lambda b: with_label(b, 1, 8, 1), ["row 1 column 8", "padding"]),
        (lambda b: replace(b, labels=b.labels[:, :-1]), ["labels has shape"]),
        (lambda b: replace(b, segment_ids=b.segment_ids[:1]), ["segment_ids has shape"]),
        (lambda b: replace(b, segments=b.segments[:1]), ["segments lists 1 rows"]),
        (lambda b: replace(b, input_ids=b.input_ids[:0], labels=b.labels[:0]), ["empty"]),
    ],
)
def test_violation_raises_naming_the_example(mutate, names: list[str]) -> None:
    with pytest.raises(BatchInvariantError) as info:
        check_batch(mutate(valid_batch()), V, "ignore")
    for name in names:
        assert name in str(info.value)


def test_keep_boundary_allows_the_cross_segment_target_only_when_declared() -> None:
    batch = compile_causal_batch(ROWS, EXAMPLES_BY_INDEX, seq_len=10, pad_id=PAD, boundary="keep")
    check_batch(batch, V, "keep", next_token_targets=True)
    with pytest.raises(BatchInvariantError, match="crosses"):
        check_batch(batch, V, "ignore")


@pytest.mark.parametrize("name", ["no shift", "double shift"])
def test_shift_errors_are_caught(name: str) -> None:
    bad = WRONG_COMPILERS[name](ROWS, EXAMPLES_BY_INDEX, seq_len=10, pad_id=PAD)
    with pytest.raises(BatchInvariantError, match="shift"):
        check_batch(bad, V, "keep", next_token_targets=True)


def test_stream_refuses_examples_with_ids_outside_the_vocabulary() -> None:
    bad = [text_example(3, [BOS, 1, 300, EOS])]
    stream = RowStream(bad, BatchConfig(seq_len=8, rows=1), pad_id=PAD, seed=0, vocab_size=V)
    with pytest.raises(BatchInvariantError, match="example 3"):
        next(iter(stream))
    unchecked = RowStream(
        bad,
        BatchConfig(seq_len=8, rows=1, check_invariants=False),
        pad_id=PAD,
        seed=0,
        vocab_size=V,
    )
    assert int(next(iter(unchecked)).input_ids.max()) == 300


def test_ignore_index_labels_are_not_supervision() -> None:
    batch = valid_batch()
    labels = torch.full_like(batch.labels, IGNORE_INDEX)
    check_batch(replace(batch, labels=labels), V, "ignore", next_token_targets=True)
