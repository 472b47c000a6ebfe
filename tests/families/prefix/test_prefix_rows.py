"""The prefix LM compiler (R8) against the pure-Python oracle, by hand and by property.

Hand-compiled rows are written out literally; random packings from the real planner
are compiled by ``families.prefix.compiler`` and by ``families.prefix.reference`` and must agree
exactly, with no supervised row able to see its target through any number of
layers. Wrong compilers (targets on prefix rows, a prefix one token too long, a
prefix one token too short) are caught by the compiler's check or the oracle.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.config import load_config
from exactstep.data.arith import arith_conversations
from exactstep.data.chat import DEFAULT_TEMPLATE
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import BatchInvariantError, ConfigError
from exactstep.families import family_of, open_family, resolve
from exactstep.families.prefix import reference as oracle
from exactstep.families.prefix.compiler import PREFIX, check_prefix_batch, compile_prefix_batch
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.inspect import render_rows
from exactstep.rows.packing import PackPlanner, Piece

PAD = 0
N = IGNORE_INDEX

# three hand examples: a chat-like one (prompt 0..2, targets 3 and 4), a text one
# (every token but the first a target) and one split so a piece starts inside its prompt
A = Example(0, np.array([1, 2, 3, 4, 5, 6]), np.array([0, 0, 0, 1, 1, 0], dtype=bool))
B = Example(1, np.array([7, 8, 9]))
C = Example(2, np.array([10, 11, 12, 13, 14, 15, 16]), np.array([0, 0, 0, 0, 0, 1, 1], dtype=bool))
HAND_ROWS = [[Piece(0, 0, 6, 0), Piece(1, 0, 3, 0)], [Piece(2, 3, 4, 1)]]
HAND_EXPECTED = {
    "input_ids": [[1, 2, 3, 4, 5, 6, 7, 8, 9, PAD], [13, 14, 15, 16, PAD, PAD, PAD, PAD, PAD, PAD]],
    "labels": [[N, N, 4, 5, N, N, 8, 9, N, N], [N, 15, 16, N, N, N, N, N, N, N]],
    "position_ids": [[0, 1, 2, 3, 4, 5, 0, 1, 2, 0], [0, 1, 2, 3, 0, 0, 0, 0, 0, 0]],
    "segment_ids": [[1, 1, 1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]],
    "prefix_len": [[3, 1], [2, 0]],  # A: 3 prompt tokens; B: the BOS; C: tokens 3, 4 of 0..4
}


def as_lists(batch) -> dict[str, list[list[int]]]:
    return {name: getattr(batch, name).tolist() for name in HAND_EXPECTED}


def oracle_examples(examples: list[Example]) -> dict[int, oracle.Example]:
    return {e.example_id: (e.tokens.tolist(), None if e.owned is None else e.owned.tolist())
            for e in examples}


def oracle_rows(rows, examples: list[Example]) -> list[list[oracle.Piece]]:
    return [[(examples[p.example].example_id, p.offset, p.length) for p in row] for row in rows]


def compile_hand(compiler=compile_prefix_batch):
    return compiler(HAND_ROWS, [A, B, C], seq_len=10, pad_id=PAD)


def test_hand_compiled_rows_are_exactly_the_written_ones():
    assert oracle.compile_rows(oracle_rows(HAND_ROWS, [A, B, C]), oracle_examples([A, B, C]),
                               10, PAD) == HAND_EXPECTED
    batch = compile_hand()
    assert as_lists(batch) == HAND_EXPECTED
    check_prefix_batch(batch)
    PREFIX.check(batch, 259, BatchConfig(seq_len=10))


def test_hand_visibility_is_the_written_one():
    # row 1: segment of 4 columns whose first 2 are the prefix, then padding
    o, x = False, True
    written = [[x, x, o, o, o, o], [x, x, o, o, o, o], [x, x, x, o, o, o], [x, x, x, x, o, o],
               [o, o, o, o, x, o], [o, o, o, o, o, x]]
    assert oracle.visible([1, 1, 1, 1, 0, 0], [2]) == written


# ------------------------------------------------------------------------ wrong compilers


def targets_on_prefix(rows, examples, **kw):
    """WRONG: every next token a target (text ownership) while the prompt stays a prefix."""
    plain = [replace(e, owned=None) for e in examples]
    batch = compile_causal_batch(rows, plain, **kw)
    return replace(batch, prefix_len=compile_prefix_batch(rows, examples, **kw).prefix_len)


def prefix_one_too_long(rows, examples, **kw):
    """WRONG: the prefix reaches the first target (the header row sees what it predicts)."""
    batch = compile_prefix_batch(rows, examples, **kw)
    lengths = torch.tensor([[s.length for s in row] + [0] * (batch.prefix_len.shape[1] - len(row))
                            for row in batch.segments])
    return replace(batch, prefix_len=torch.minimum(batch.prefix_len + 1, lengths))


def prefix_one_too_short(rows, examples, **kw):
    """WRONG (safe but not the declared rule): the last prompt token left causal."""
    batch = compile_prefix_batch(rows, examples, **kw)
    return replace(batch, prefix_len=(batch.prefix_len - 1).clamp(min=0))


def leaking_rows(batch, layers: int = 2) -> list[tuple[int, int]]:
    out = []
    for b in range(batch.shape[0]):
        seg, prefix = batch.segment_ids[b].tolist(), batch.prefix_len[b].tolist()
        view = oracle.visible(seg, prefix)
        out += [(b, i) for i in oracle.rows_seeing_their_target(
            batch.labels[b].tolist(), seg, view, layers)]
    return out


def test_the_right_compiler_leaks_nothing_and_the_leaky_ones_are_caught():
    assert leaking_rows(compile_hand()) == []
    for wrong in (targets_on_prefix, prefix_one_too_long):
        batch = compile_hand(wrong)
        assert leaking_rows(batch) != [], wrong.__name__
        with pytest.raises(BatchInvariantError, match="inside the segment's bidirectional prefix"):
            check_prefix_batch(batch)
    # the oracle sees the leak through depth: one layer of prefix visibility is enough
    assert leaking_rows(compile_hand(prefix_one_too_long), layers=1) != []


def test_a_prefix_one_too_short_is_safe_but_not_the_rule():
    batch = compile_hand(prefix_one_too_short)
    assert leaking_rows(batch) == []
    check_prefix_batch(batch)  # not a leak, so the invariant passes ...
    assert as_lists(batch) != HAND_EXPECTED  # ... but the oracle comparison fails


def test_malformed_prefix_lengths_are_refused_naming_the_example():
    batch = compile_hand()
    with pytest.raises(BatchInvariantError, match=r"example 2, piece 1.*outside \[0, 4\]"):
        check_prefix_batch(replace(batch, prefix_len=torch.tensor([[3, 1], [5, 0]])))
    with pytest.raises(BatchInvariantError, match="prefix_len has shape"):
        check_prefix_batch(replace(batch, prefix_len=torch.tensor([[3], [2]])))
    with pytest.raises(BatchInvariantError, match="prefix_len has shape None"):
        check_prefix_batch(replace(batch, prefix_len=None))


# ------------------------------------------------------------------------ properties


@st.composite
def prompt_examples(draw) -> list[Example]:
    """Examples whose ownership is a prompt then targets (some unowned gaps), or text."""
    out = []
    for i in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, 20))
        tokens = np.array(draw(st.lists(st.integers(1, 250), min_size=n, max_size=n)))
        owned = None
        if draw(st.booleans()):
            prompt = draw(st.integers(1, n))
            tail = draw(st.lists(st.booleans(), min_size=n - prompt, max_size=n - prompt))
            owned = np.array([False] * prompt + tail, dtype=bool)
        out.append(Example(i, tokens, owned))
    return out


@settings(max_examples=40, deadline=None)
@given(prompt_examples(), st.integers(2, 16), st.integers(1, 4), st.integers(0, 99))
def test_compiler_equals_the_oracle_on_planned_rows(examples, seq_len, rows, seed):
    planner = PackPlanner(examples, seq_len=seq_len, buffer=4, overlong="split", seed=seed)
    planned = planner.next_rows(rows)
    batch = compile_prefix_batch(planned, examples, seq_len=seq_len, pad_id=PAD)
    expected = oracle.compile_rows(oracle_rows(planned, examples), oracle_examples(examples),
                                   seq_len, PAD)
    assert as_lists(batch) == expected
    PREFIX.check(batch, 259, BatchConfig(seq_len=seq_len))
    assert leaking_rows(batch) == []


# ------------------------------------------------------------------------ chat data


def test_arith_prefix_is_the_rendered_prompt_of_the_first_question():
    """Independent of ownership: the template's own prompt for the first user turn
    (the question plus the assistant header) is exactly the segment's prefix."""
    tokenizer = ByteTokenizer()
    conversations = arith_conversations(0, 6, split="train")
    examples, _ = chat_examples(conversations, tokenizer, ChatPolicy(), max_len=128)
    rows = [[Piece(k, 0, len(e), 0)] for k, e in enumerate(examples)]
    batch = compile_prefix_batch(rows, examples, seq_len=128, pad_id=tokenizer.pad_id)
    for k, conversation in enumerate(conversations):
        prompt = DEFAULT_TEMPLATE.render_prompt(conversation.messages[:1], tokenizer).tokens
        assert int(batch.prefix_len[k, 0]) == len(prompt)
        first = int((batch.labels[k] != IGNORE_INDEX).nonzero()[0, 0])
        assert first == len(prompt) - 1  # the last prompt row predicts the first answer token
    last_only, _ = chat_examples(conversations, tokenizer, ChatPolicy(turns="last"), max_len=128)
    batch = compile_prefix_batch(rows, last_only, seq_len=128, pad_id=tokenizer.pad_id)
    for k, conversation in enumerate(conversations):  # turns = last: all but the last answer
        prompt = DEFAULT_TEMPLATE.render_prompt(conversation.messages[:-1], tokenizer).tokens
        assert int(batch.prefix_len[k, 0]) == len(prompt)


def test_prefix_family_resolves_to_arith_chat_and_inspect_shows_the_prefix():
    cfg = resolve(load_config(None, ["objective.family=prefix", "batch.seq_len=64",
                                     "batch.rows=2", "arith.n_train=40", "arith.n_heldout=4"]))
    assert (cfg.data.source, cfg.data.kind, cfg.objective.family) == ("arith", "chat", "prefix")
    family = family_of(cfg)
    assert family.objective(cfg)["family"] == "prefix_lm"
    parts = open_family(cfg)
    examples = parts.data.train[:1]
    batch = parts.compiler.compile([[Piece(0, 0, len(examples[0]), 0)]], examples, cfg.batch,
                                   pad_id=parts.tokenizer.pad_id, weighted=False)
    p = int(batch.prefix_len[0, 0])
    shown = render_rows(batch, parts.tokenizer, range(1)).splitlines()
    column = {int(line.split()[0]): line for line in shown[3:]}
    assert column[0].endswith(f"cols 0..{p - 1}")  # the first prompt row sees the whole prompt
    assert column[p].endswith(f"cols 0..{p}")  # the first answer row is causal


def test_a_hugging_face_model_is_refused_for_the_prefix_family():
    cfg = resolve(load_config(None, ["objective.family=prefix", "model.source=hf",
                                     "model.path=/nonexistent"]))
    with pytest.raises(ConfigError, match="built-in decoder"):
        family_of(cfg).build_model(cfg, 259)
