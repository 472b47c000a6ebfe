"""The built-in chat template and the chat JSONL loader (R5, S1, X4)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from exactstep.data.chat import DEFAULT_TEMPLATE, ChatTemplate, Part, Role, load_chat_jsonl
from exactstep.data.conversation import (
    Conversation,
    Message,
    parse_conversation,
    write_chat_jsonl,
)
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError

TOK = ByteTokenizer()


def test_render_emits_every_token_with_its_role_and_part_exactly():
    messages = (Message("user", "hi"), Message("assistant", "ok", ('{"f":1}',)))
    r = DEFAULT_TEMPLATE.render(messages, TOK)
    expected_text = '<bos><|user|>\nhi<eos><|assistant|>\nok<|tool_call|>{"f":1}\n<eos>'
    assert TOK.decode(r.tokens) == expected_text
    n_user_header, n_asst_header, n_call = len("<|user|>\n"), len("<|assistant|>\n"), len('<|tool_call|>{"f":1}\n')
    expected_parts = (
        [Part.BEGIN] + [Part.HEADER] * n_user_header + [Part.CONTENT] * 2 + [Part.END_OF_TURN]
        + [Part.HEADER] * n_asst_header + [Part.CONTENT] * 2 + [Part.TOOL_CALL] * n_call
        + [Part.END_OF_TURN]
    )
    expected_roles = [Role.NONE] + [Role.USER] * (n_user_header + 3) + [Role.ASSISTANT] * (n_asst_header + 2 + n_call + 1)
    expected_messages = [-1] + [0] * (n_user_header + 3) + [1] * (n_asst_header + 2 + n_call + 1)
    assert r.part.tolist() == [int(p) for p in expected_parts]
    assert r.role.tolist() == [int(x) for x in expected_roles]
    assert r.message.tolist() == expected_messages
    assert r.tokens.dtype == np.int64 and len(r) == len(expected_parts)


def test_prompt_is_the_rendering_prefix_up_to_the_assistant_header():
    messages = (Message("user", "What is 1+2?"), Message("assistant", "3"))
    full = DEFAULT_TEMPLATE.render(messages, TOK)
    prompt = DEFAULT_TEMPLATE.render_prompt(messages[:1], TOK)
    n = len(prompt)
    assert full.tokens[:n].tolist() == prompt.tokens.tolist()
    assert full.part[n] == Part.CONTENT and full.part[n - 1] == Part.HEADER
    assert TOK.decode(prompt.tokens).endswith("<|assistant|>\n")


def test_fingerprint_is_stable_and_changes_with_the_definition():
    assert DEFAULT_TEMPLATE.fingerprint(TOK) == ChatTemplate().fingerprint(TOK)
    assert len(DEFAULT_TEMPLATE.fingerprint(TOK)) == 64
    changed = ChatTemplate(header="[{role}]\n")
    assert changed.fingerprint(TOK) != DEFAULT_TEMPLATE.fingerprint(TOK)


def test_tool_call_rendering_ignores_source_key_order():
    a = parse_conversation({"messages": [{"role": "assistant", "content": None,
                                          "tool_calls": [{"name": "f", "args": {"y": 1, "x": 2}}]}]}, "a")
    b = parse_conversation({"messages": [{"role": "assistant", "content": "",
                                          "tool_calls": [{"args": {"x": 2, "y": 1}, "name": "f"}]}]}, "b")
    assert DEFAULT_TEMPLATE.render(a.messages, TOK).tokens.tolist() == \
        DEFAULT_TEMPLATE.render(b.messages, TOK).tokens.tolist()


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("{not json", "not valid JSON"),
        ('{"messages": []}', "non-empty list"),
        ('{"text": "x"}', '"messages"'),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "unknown role 'bot'"),
        ('{"messages": [{"role": "user"}]}', '"content" is missing'),
        ('{"messages": [{"role": "user", "content": 3}]}', "is not a string"),
        ('{"messages": [{"role": "user", "content": "x", "tool_calls": []}]}', "only assistant"),
        ('{"messages": ["hello"]}', "must be an object"),
        ('{"messages": "hi"}', "non-empty list of messages, got a JSON string"),
        ('[{"role": "user", "content": "x"}]', '"messages" list, got a JSON array'),
        ('{"messages": [{"content": "x"}]}', '"role" is missing'),
        ('{"messages": [{"role": 5, "content": "x"}]}', "unknown role 5"),
        ('{"messages": [{"role": "user", "content": ["x"]}]}', "is not a string (got a JSON array)"),
        ('{"messages": [{"role": "user", "contnet": "x"}]}', "unknown key 'contnet'"),
        ('{"messages": [{"role": "assistant", "content": null, "tool_calls": [5, null]}]}',
         '"tool_calls" item 0 must be a JSON object'),
        ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"f": 1}, null]}]}',
         '"tool_calls" item 1 must be a JSON object'),
        ('{"messages": [{"role": "assistant", "content": "x", "tool_calls": {"f": 1}}]}',
         '"tool_calls" must be a list of JSON objects, got a JSON object'),
        ('{"messages": [{"role": "assistant", "content": null, "tool_calls": []}]}',
         '"content" is missing'),
        ('{"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"a": NaN}]}]}',
         '"tool_calls" item 0 holds NaN or Infinity'),
        ('{"messages": [{"role": "user", "role": "assistant", "content": "x"}]}',
         "key 'role' appears twice"),
        ('{"messages": [{"role": "user", "content": "a\\udc00"}]}',
         '"content" holds an unpaired surrogate'),
        ('{"messages": [{"role": "assistant", "content": "", "tool_calls": [{"a": "\\ud800"}]}]}',
         '"tool_calls" item 0 holds an unpaired surrogate'),
        ('{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    ],
)
def test_malformed_lines_raise_data_error_naming_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "ok"}]})
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(DataError) as info:
        load_chat_jsonl(path)
    assert f"{path}:3" in str(info.value)
    assert fragment in str(info.value)


def test_invalid_utf8_is_a_data_error_naming_file_line_and_byte(tmp_path):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "ok"}]}).encode()
    prefix = '{"messages": [{"role": "user", "content": "'
    path.write_bytes(good + b"\n" + prefix.encode() + b'\xe9"}]}\n')
    with pytest.raises(DataError) as info:
        load_chat_jsonl(path)
    column = len(prefix) + 1  # 1-based column of the Latin-1 byte
    assert f"{path}:2: not valid UTF-8 (byte 0xe9 at column {column})" in str(info.value)


def test_well_formed_shapes_load_negative_control(tmp_path):
    """The shapes refused above are refused for their shape: the nearest well-formed
    lines (tool calls as objects, content null beside a call, other top-level keys,
    non-ASCII text, a BOM) load and keep every field."""
    path = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "caf\u00e9"},
                      {"role": "assistant", "content": None, "tool_calls": [{"name": "f"}, {}]}],
         "id": 7},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "x",
                                                             "tool_calls": None}]},
    ]
    text = "\n".join(json.dumps(line, ensure_ascii=False) for line in lines) + "\n"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    first, second = load_chat_jsonl(path)
    assert first.messages == (Message("user", "caf\u00e9"),
                              Message("assistant", "", ('{"name":"f"}', "{}")))
    assert second.messages == (Message("system", "s"), Message("user", "x"))


def test_missing_and_empty_files_are_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_chat_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no conversation"):
        load_chat_jsonl(tmp_path / "empty.jsonl")


def test_writer_round_trips_through_the_loader(tmp_path):
    conversations = [
        Conversation((Message("system", "be brief"), Message("user", "héllo\n\"q\""),
                      Message("assistant", "", ('{"name":"f"}',)), Message("tool", "42"),
                      Message("assistant", "done"))),
        Conversation((Message("user", "x"),)),
    ]
    path = write_chat_jsonl(conversations, tmp_path / "out" / "c.jsonl")
    loaded = load_chat_jsonl(path)
    assert [c.messages for c in loaded] == [c.messages for c in conversations]
    assert loaded[0].name == f"{path}:1"


def test_a_message_built_in_code_with_an_unknown_role_is_a_data_error():
    with pytest.raises(DataError, match="unknown chat role 'bot'"):
        DEFAULT_TEMPLATE.render((Message("bot", "x"),), TOK)
