"""Chat SFT ownership on target tokens, shifted once to rows (R1, R2, R5).

Each important check is also run on a deliberately wrong compiler (ownership applied
to input rows without the shift) and must fail there: the negative control.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exactstep.data.chat import DEFAULT_TEMPLATE, Part, Role
from exactstep.data.conversation import Conversation, Message
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError, DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.chat import (
    ChatPolicy,
    ChatReport,
    chat_example,
    chat_examples,
    row_ownership,
    target_ownership,
)
from exactstep.rows.example import Example
from exactstep.rows.packing import Piece

TOK = ByteTokenizer()
Compiler = Callable[[Sequence[Example], int], Batch]


def compile_rows(examples: Sequence[Example], seq_len: int) -> Batch:
    """The real collator: one example per row, the shift applied by the compiler (R1)."""
    rows = [[Piece(example=i, offset=0, length=len(e), piece=0)] for i, e in enumerate(examples)]
    return compile_causal_batch(rows, examples, seq_len=seq_len, pad_id=TOK.pad_id)


def compile_rows_unshifted(examples: Sequence[Example], seq_len: int) -> Batch:
    """WRONG on purpose: row i is supervised when token i (its input) is owned."""
    batch = compile_rows(examples, seq_len)
    labels = batch.labels.clone()
    for r, example in enumerate(examples):
        n = len(example)
        owned_inputs = example.owned[: n - 1]
        labels[r, : n - 1] = IGNORE_INDEX
        targets = example.tokens[1:n]
        labels[r, : n - 1][owned_inputs] = torch.as_tensor(targets[owned_inputs])
    return Batch(input_ids=batch.input_ids, labels=labels, position_ids=batch.position_ids,
                 segment_ids=batch.segment_ids, segments=batch.segments)


def supervised_pairs(batch: Batch, row: int) -> list[tuple[str, str]]:
    """(input token, target token) of every supervised row, as printable text."""
    pairs = []
    for i in range(batch.shape[1]):
        label = int(batch.labels[row, i])
        if label != IGNORE_INDEX:
            pairs.append((TOK.token_text(int(batch.input_ids[row, i])), TOK.token_text(label)))
    return pairs


# --------------------------------------------------------------------------- the trace

TRACE = Conversation((
    Message("system", "S"),
    Message("user", "U1"),
    Message("assistant", "hi"),
    Message("user", "U2"),
    Message("assistant", "yo"),
))

# Worked by hand from R5: the row holding the assistant header's last byte ("\n")
# predicts the first answer byte; answer rows predict the next byte and the
# end-of-turn marker; nothing else is supervised.
TRACE_SUPERVISED = [
    ("\\n", "h"), ("h", "i"), ("i", "<eos>"),
    ("\\n", "y"), ("y", "o"), ("o", "<eos>"),
]


# Column layout of the rendered trace (worked by hand; asserted below):
#   0 <bos> | 1..11 "<|system|>\n" | 12 S | 13 <eos> | 14..22 "<|user|>\n" | 23..24 U1
#   25 <eos> | 26..39 "<|assistant|>\n" | 40..41 hi | 42 <eos> | 43..51 "<|user|>\n"
#   52..53 U2 | 54 <eos> | 55..68 "<|assistant|>\n" | 69..70 yo | 71 <eos>
TRACE_TEXT = "<bos><|system|>\nS<eos><|user|>\nU1<eos><|assistant|>\nhi<eos><|user|>\nU2<eos><|assistant|>\nyo<eos>"
ASSISTANT_HEADER_ROWS = (39, 68)  # hold the header's last byte; predict "h" / "y"
ROWS_BEFORE_USER_HEADERS = (13, 42)  # their next token opens a user turn


def trace_ownership_holds(compiler: Compiler) -> bool:
    example = chat_example(TRACE, 0, TOK, ChatPolicy(), max_len=128)
    assert TOK.decode(example.tokens) == TRACE_TEXT and len(example) == 72
    batch = compiler([example], 128)
    labels = batch.labels[0].tolist()
    return (
        supervised_pairs(batch, 0) == TRACE_SUPERVISED
        and [labels[i] for i in ASSISTANT_HEADER_ROWS] == TOK.encode("hy")
        and all(labels[i] == IGNORE_INDEX for i in ROWS_BEFORE_USER_HEADERS)
    )


def test_chat_trace_header_row_owns_first_answer_token():
    assert trace_ownership_holds(compile_rows)


def test_chat_trace_negative_control_unshifted_ownership_fails():
    assert not trace_ownership_holds(compile_rows_unshifted)
    # The characteristic damage: the first answer token is lost and an end-of-turn
    # row predicting the next user header enters the loss.
    example = chat_example(TRACE, 0, TOK, ChatPolicy(), max_len=128)
    wrong = supervised_pairs(compile_rows_unshifted([example], 128), 0)
    assert ("\\n", "h") not in wrong
    assert ("<eos>", "<") in wrong


def test_target_and_row_ownership_on_the_trace_are_exact():
    rendered = DEFAULT_TEMPLATE.render(TRACE.messages, TOK)
    a = target_ownership(rendered, ChatPolicy())
    owned_text = "".join(TOK.token_text(int(t)) for t in rendered.tokens[a])
    assert owned_text == "hi<eos>yo<eos>"
    rows = row_ownership(a)
    assert rows[:-1].tolist() == a[1:].tolist() and not rows[-1]


# --------------------------------------------------------------------------- policies


def owned_text(conversation: Conversation, policy: ChatPolicy) -> str:
    rendered = DEFAULT_TEMPLATE.render(conversation.messages, TOK)
    return "".join(TOK.token_text(int(t)) for t in rendered.tokens[target_ownership(rendered, policy)])


TOOLS = Conversation((
    Message("user", "q"),
    Message("assistant", "a", ('{"n":1}',)),
    Message("tool", "r"),
    Message("assistant", "b"),
))


@pytest.mark.parametrize(
    "policy, expected",
    [
        (ChatPolicy(), 'a<|tool_call|>{"n":1}\\n<eos>b<eos>'),
        (ChatPolicy(supervise_tool_calls=False), "a<eos>b<eos>"),
        (ChatPolicy(supervise_eot=False), 'a<|tool_call|>{"n":1}\\nb'),
        (ChatPolicy(turns="last"), "b<eos>"),
        (ChatPolicy(turns="last", supervise_eot=False, supervise_tool_calls=False), "b"),
    ],
)
def test_policy_knobs_select_exact_target_spans(policy, expected):
    assert owned_text(TOOLS, policy).replace("␣", " ") == expected


def test_policy_rejects_unknown_choices():
    with pytest.raises(ConfigError, match="chat.turns"):
        ChatPolicy(turns="first")
    with pytest.raises(ConfigError, match="chat.empty"):
        ChatPolicy(empty="skip")


# --------------------------------------------------------------------------- truncation

LONG_PROMPT = Conversation((Message("user", "x" * 40), Message("assistant", "ok")), name="f.jsonl:7")


def test_truncation_keeps_head_and_counts_lost_targets():
    report = ChatReport()
    # prompt part: bos + header(9) + 40 + eos + header(14) = 65 tokens; then "ok", eos.
    example = chat_example(LONG_PROMPT, 3, TOK, ChatPolicy(), max_len=66, report=report)
    assert len(example) == 66 and example.example_id == 3
    assert int(example.owned.sum()) == 1  # only "o" survives
    assert (report.truncated, report.tokens_cut, report.targets_cut) == (1, 2, 2)


def test_conversation_left_without_target_is_dropped_and_counted():
    examples, report = chat_examples([LONG_PROMPT, TRACE], TOK, ChatPolicy(), max_len=65)
    assert report.dropped_empty == 1 and report.kept == 1 and report.conversations == 2
    assert [e.example_id for e in examples] == [1]


def test_conversation_left_without_target_raises_naming_it_under_error():
    with pytest.raises(DataError, match=r"f\.jsonl:7 \(example 0\).*no supervised token"):
        chat_examples([LONG_PROMPT], TOK, ChatPolicy(empty="error"), max_len=65)


def test_conversation_without_assistant_is_an_empty_outcome_too():
    only_user = Conversation((Message("user", "hello"),))
    _, report = chat_examples([only_user], TOK, ChatPolicy(), max_len=64)
    assert report.dropped_empty == 1
    with pytest.raises(DataError):
        chat_examples([only_user], TOK, ChatPolicy(empty="error"), max_len=64)


# --------------------------------------------------------------------------- properties


def reference_ownership(conversation: Conversation, policy: ChatPolicy) -> list[bool]:
    """An independent reading of R5, built from message strings, not from the template's
    role arrays: lengths of header, content, tool calls and end-of-turn per message."""
    last_assistant = max((k for k, m in enumerate(conversation.messages) if m.role == "assistant"), default=-1)
    owned = [False]  # BOS
    for k, m in enumerate(conversation.messages):
        selected = m.role == "assistant" and (policy.turns == "all" or k == last_assistant)
        owned += [False] * len(TOK.encode(f"<|{m.role}|>\n"))
        owned += [selected] * len(TOK.encode(m.content))
        for call in m.tool_calls:
            owned += [selected and policy.supervise_tool_calls] * len(TOK.encode(f"<|tool_call|>{call}\n"))
        owned += [selected and policy.supervise_eot]
    return owned


content = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
tool_call = st.sampled_from(['{"name":"f"}', '{"a":[1,2]}', '"x"'])
message = st.one_of(
    st.builds(Message, st.sampled_from(["system", "user", "tool"]), content),
    st.builds(Message, st.just("assistant"), content, st.lists(tool_call, max_size=2).map(tuple)),
)
conversations = st.lists(message, min_size=1, max_size=6).map(lambda ms: Conversation(tuple(ms)))
policies = st.builds(
    ChatPolicy,
    turns=st.sampled_from(["all", "last"]),
    supervise_eot=st.booleans(),
    supervise_tool_calls=st.booleans(),
)


def check_rows(conversation: Conversation, policy: ChatPolicy, compiler: Compiler) -> None:
    """Every R5 property of one compiled conversation; raises AssertionError on a breach."""
    example = chat_example(conversation, 0, TOK, policy, max_len=4096)
    expected = reference_ownership(conversation, policy)
    if example is None:  # no supervised target at all: the reference agrees
        assert not any(expected[1:])
        return
    rendered = DEFAULT_TEMPLATE.render(conversation.messages, TOK)
    n = len(example)
    assert example.owned.tolist() == expected
    batch = compiler([example], n)
    labels = batch.labels[0].numpy()  # [n]
    rows_owned = labels != IGNORE_INDEX
    # Row ownership is target ownership shifted by one, with the next token as label.
    assert rows_owned[: n - 1].tolist() == example.owned[1:].tolist() and not rows_owned[n - 1]
    assert (labels[: n - 1][rows_owned[: n - 1]] == example.tokens[1:][rows_owned[: n - 1]]).all()
    # Supervised rows == owned targets after the shift.
    assert int(rows_owned.sum()) == int(example.owned[1:].sum())
    target_role = rendered.role[1:]  # role of token i+1, seen from row i
    target_part = rendered.part[1:]
    sup = rows_owned[: n - 1]
    # Prompt, header, system and tool-result targets are never supervised...
    assert (target_role[sup] == Role.ASSISTANT).all()
    assert not (target_part[sup] == Part.HEADER).any()
    assert not (target_role[sup] == Role.TOOL).any()
    # ...yet stay visible: one segment id covers prompt and answer alike (R2).
    assert (batch.segment_ids[0, :n] == 1).all()
    # End-of-turn supervision follows the knob; `last` touches only the final turn.
    eot_targets = sup & (target_part == Part.END_OF_TURN)
    assert eot_targets.any() == policy.supervise_eot
    if policy.turns == "last":
        final = rendered.message[rendered.role == Role.ASSISTANT].max()
        assert (rendered.message[1:][sup] == final).all()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations, policies)
def test_row_ownership_properties_over_random_conversations(conversation, policy):
    check_rows(conversation, policy, compile_rows)


def test_property_check_catches_the_unshifted_compiler():
    conversation = Conversation((Message("user", "2+2?"), Message("assistant", "4"), Message("user", "ok")))
    check_rows(conversation, ChatPolicy(), compile_rows)
    with pytest.raises(AssertionError):
        check_rows(conversation, ChatPolicy(), compile_rows_unshifted)


def test_property_check_catches_ownership_that_leaks_headers():
    """A policy that (wrongly) owned the assistant header must fail the reference check."""
    import exactstep.rows.chat as chat_module

    conversation = Conversation((Message("user", "q"), Message("assistant", "a")))
    original = ChatPolicy.supervised_parts

    def leaky(self):
        return (*original(self), Part.HEADER)

    chat_module.ChatPolicy.supervised_parts = leaky
    try:
        with pytest.raises(AssertionError):
            check_rows(conversation, ChatPolicy(), compile_rows)
    finally:
        chat_module.ChatPolicy.supervised_parts = original


def test_packed_conversations_supervise_nothing_across_the_boundary():
    a = chat_example(TRACE, 0, TOK, ChatPolicy(), max_len=128)
    b = chat_example(TOOLS, 1, TOK, ChatPolicy(), max_len=128)
    row = [[Piece(0, 0, len(a), 0), Piece(1, 0, len(b), 0)]]
    batch = compile_causal_batch(row, [a, b], seq_len=len(a) + len(b) + 3, pad_id=TOK.pad_id)
    labels = batch.labels[0]
    assert int(labels[len(a) - 1]) == IGNORE_INDEX  # a's last EOS row does not predict b's BOS
    assert batch.num_targets() == int(a.owned[1:].sum() + b.owned[1:].sum())
