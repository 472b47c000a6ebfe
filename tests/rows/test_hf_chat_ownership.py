"""Hugging Face chat templates -> ownership, through the one chat compiler (R5, H2).

Three template styles written as Jinja in ``tokenizer_support`` (ChatML-like, Llama-3-like,
Gemma-like), each with and without ``{% generation %}`` markers. The expectation is
written by hand: the exact text each template must render, cut into pieces, each
labelled with what it is (``P`` never a target: system, user, tool and header
tokens; ``C`` content, ``T`` tool call, ``E`` end-of-turn marker, ``S`` separator
after it), followed by the assistant turn it belongs to. The raw ``tokenizers``
library turns the pieces into the expected token ids and per-token labels; exactstep
must render the same ids and own exactly the labelled targets, in both modes.

Negative controls: a derivation off by one token, a template whose generation block
is one token too wide, a shifted mask, a template that is not prefix-stable, one that
renders no assistant tokens, and one that leaves the end-of-turn marker outside its
generation: each is caught.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizer_support import (
    BYTES,
    BYTES_MARKED,
    EOT_OUTSIDE_MARKED,
    NO_ASSISTANT,
    NO_ASSISTANT_MARKED,
    PHI3_STYLE,
    PHI3_STYLE_MARKED,
    PHI3_STYLE_MARKS_USERS,
    REASONING_MARKED,
    TEMPLATES,
    UNSTABLE,
    UNSTABLE_MARKED,
    expected_tokens,
    jinja,
    save_byte_tokenizer,
    save_tokenizer,
)

from exactstep.data.arith import arith_conversations
from exactstep.data.chat import DEFAULT_TEMPLATE, Part, Role, template_for
from exactstep.data.conversation import Conversation, Message
from exactstep.data.hf_chat import HFChatTemplate
from exactstep.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError
from exactstep.rows.chat import ChatPolicy, ChatReport, chat_example, target_ownership

CONV = Conversation((
    Message("system", "Be brief."),
    Message("user", "What is 2+2?"),
    Message("assistant", "4"),
    Message("user", "And 3+3?"),
    Message("assistant", "6, of course."),
), name="chat.jsonl:7")

CALL = '{"arguments":{"city":"Paris"},"name":"weather"}'  # canonical JSON, as loaded
TOOLS = Conversation((
    Message("user", "Weather in Paris?"),
    Message("assistant", "", (CALL,)),
    Message("tool", "18C"),
    Message("assistant", "It is 18C."),
), name="tools.jsonl:2")

# The exact renderings, by hand. ``P`` pieces are never targets; the digit after a
# label is the assistant turn (1 = first).
PIECES = {
    "chatml": [
        ("<|im_start|>system\nBe brief.<|im_end|>\n", "P"),
        ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "P"),
        ("<|im_start|>assistant\n", "P"),
        ("4", "C1"), ("<|im_end|>", "E1"), ("\n", "S1"),
        ("<|im_start|>user\nAnd 3+3?<|im_end|>\n", "P"),
        ("<|im_start|>assistant\n", "P"),
        ("6, of course.", "C2"), ("<|im_end|>", "E2"), ("\n", "S2"),
    ],
    "llama3": [
        ("<|begin_of_text|>", "P"),
        ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>", "P"),
        ("<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>", "P"),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", "P"),
        ("4", "C1"), ("<|eot_id|>", "E1"),
        ("<|start_header_id|>user<|end_header_id|>\n\nAnd 3+3?<|eot_id|>", "P"),
        ("<|start_header_id|>assistant<|end_header_id|>\n\n", "P"),
        ("6, of course.", "C2"), ("<|eot_id|>", "E2"),
    ],
    "gemma": [  # the system prompt is folded into the first user turn
        ("<s><start_of_turn>user\nBe brief.\n\nWhat is 2+2?<end_of_turn>\n", "P"),
        ("<start_of_turn>model\n", "P"),
        ("4", "C1"), ("<end_of_turn>", "E1"), ("\n", "S1"),
        ("<start_of_turn>user\nAnd 3+3?<end_of_turn>\n", "P"),
        ("<start_of_turn>model\n", "P"),
        ("6, of course.", "C2"), ("<end_of_turn>", "E2"), ("\n", "S2"),
    ],
}
TOOL_PIECES = [
    ("<|im_start|>user\nWeather in Paris?<|im_end|>\n", "P"),
    ("<|im_start|>assistant\n", "P"),
    ('<tool_call>{"arguments": {"city": "Paris"}, "name": "weather"}</tool_call>', "T1"),
    ("<|im_end|>", "E1"), ("\n", "S1"),
    ("<|im_start|>tool\n18C<|im_end|>\n", "P"),
    ("<|im_start|>assistant\n", "P"),
    ("It is 18C.", "C2"), ("<|im_end|>", "E2"), ("\n", "S2"),
]
# Each policy as the labels it supervises and the turns it selects.
POLICIES = {
    "default": (ChatPolicy(), "CTE", (1, 2)),
    "no-eot": (ChatPolicy(supervise_eot=False), "CT", (1, 2)),
    "last-turn": (ChatPolicy(turns="last"), "CTE", (2,)),
    "no-tool-calls": (ChatPolicy(supervise_tool_calls=False), "CE", (1, 2)),
}


def expected_mask(kinds: list[str], policy: str) -> np.ndarray:
    _, labels, turns = POLICIES[policy]
    return np.array([k[0] in labels and k != "P" and int(k[1:]) in turns for k in kinds])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[tuple[str, bool], tuple[HFTokenizer, Path]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for (style, marked), source in TEMPLATES.items():
        directory = save_tokenizer(root / f"{style}-{marked}", chat_template=source)
        out[style, marked] = (load_hf_tokenizer(directory), directory)
    return out


def owned(tok: HFTokenizer, conversation: Conversation, policy: ChatPolicy,
          template: HFChatTemplate | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, target ownership) as the run's compiler decides them."""
    template = template or template_for(tok)
    example = chat_example(conversation, 0, tok, policy, max_len=4096, template=template)
    return example.tokens, example.owned


CASES = [(style, marked, policy) for style in PIECES for marked in (False, True)
         for policy in ("default", "no-eot", "last-turn")]


@pytest.mark.parametrize(("style", "marked", "policy"), CASES,
                         ids=[f"{s}-{'markers' if m else 'prefixes'}-{p}" for s, m, p in CASES])
def test_ownership_matches_the_hand_written_mask(tokenizers, style, marked, policy) -> None:
    tok, directory = tokenizers[style, marked]
    assert template_for(tok).ownership == ("generation-markers" if marked else "growing-prefixes")
    want_ids, kinds = expected_tokens(directory, PIECES[style])
    tokens, got = owned(tok, CONV, POLICIES[policy][0])
    assert tokens.tolist() == want_ids
    np.testing.assert_array_equal(got, expected_mask(kinds, policy))


@pytest.mark.parametrize("marked", [False, True], ids=["prefixes", "markers"])
@pytest.mark.parametrize("policy", ["default", "no-tool-calls", "last-turn"])
def test_tool_calls_follow_the_policy_and_tool_results_are_never_owned(tokenizers, marked,
                                                                       policy) -> None:
    tok, directory = tokenizers["chatml", marked]
    want_ids, kinds = expected_tokens(directory, TOOL_PIECES)
    tokens, got = owned(tok, TOOLS, POLICIES[policy][0])
    assert tokens.tolist() == want_ids
    np.testing.assert_array_equal(got, expected_mask(kinds, policy))


@pytest.mark.parametrize("source", [BYTES, BYTES_MARKED], ids=["prefixes", "markers"])
def test_the_built_in_template_in_jinja_owns_what_the_built_in_template_owns(tmp_path,
                                                                            source) -> None:
    """Two implementations of one template: the built-in renderer, and its Jinja
    rewriting through a Hugging Face byte tokenizer and this derivation. Same tokens
    and the same target ownership under every policy, tool calls and results included."""
    tok = load_hf_tokenizer(save_byte_tokenizer(tmp_path / "tok", source))
    assert (tok.vocab_size, tok.special_ids()) == (259, {"bos": 256, "eos": 257, "pad": 258})
    template = template_for(tok)
    conversations = [*arith_conversations(0, 30, split="train"), TOOLS]
    for conversation in conversations:
        built_in = DEFAULT_TEMPLATE.render(conversation.messages, ByteTokenizer())
        derived = template.render(conversation.messages, tok)
        np.testing.assert_array_equal(derived.tokens, built_in.tokens)
        for policy, _, _ in POLICIES.values():
            np.testing.assert_array_equal(target_ownership(derived, policy),
                                          target_ownership(built_in, policy))


def test_negative_control_a_jinja_rewriting_that_differs_in_one_detail_is_seen(tmp_path) -> None:
    """Tool calls as ``tojson``'s default (spaced) JSON: the comparison above fails."""
    spaced = BYTES_MARKED.replace("tojson(separators=(',', ':'), sort_keys=True)", "tojson")
    assert spaced != BYTES_MARKED
    tok = load_hf_tokenizer(save_byte_tokenizer(tmp_path / "tok", spaced))
    derived = template_for(tok).render(TOOLS.messages, tok)
    built_in = DEFAULT_TEMPLATE.render(TOOLS.messages, ByteTokenizer())
    assert len(derived) != len(built_in)


def test_roles_messages_and_parts_of_a_rendering(tokenizers) -> None:
    tok, directory = tokenizers["chatml", False]
    rendered = template_for(tok).render(TOOLS.messages, tok)
    _, kinds = expected_tokens(directory, TOOL_PIECES)
    part_of = {"C": Part.CONTENT, "T": Part.TOOL_CALL, "E": Part.END_OF_TURN,
               "S": Part.SEPARATOR}
    assistant = rendered.role == Role.ASSISTANT
    for j, kind in enumerate(kinds):
        if kind != "P":
            assert assistant[j] and rendered.part[j] == part_of[kind[0]], j
    assert sorted(set(rendered.message[assistant].tolist())) == [1, 3]
    headers = assistant & (np.array(kinds) == "P")
    assert headers.sum() == 2 * len(tok.encode("<|im_start|>assistant\n"))
    assert (rendered.part[headers] == Part.HEADER).all()
    tool = rendered.role == Role.TOOL
    assert tok.decode(rendered.tokens[tool]) == "<|im_start|>tool\n18C<|im_end|>\n"


def test_the_prompt_is_the_conversation_up_to_the_last_header(tokenizers) -> None:
    tok, directory = tokenizers["llama3", False]
    want_ids, _ = expected_tokens(directory, PIECES["llama3"][:8])
    prompt = template_for(tok).render_prompt(CONV.messages[:4], tok)
    assert prompt.tokens.tolist() == want_ids
    header = prompt.message == 4
    assert tok.decode(prompt.tokens[header]) == "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert (prompt.role[header] == Role.ASSISTANT).all()
    assert (prompt.part[header] == Part.HEADER).all()


def test_a_conversation_without_assistant_turns_is_the_empty_policys_case(tokenizers) -> None:
    tok, _ = tokenizers["chatml", False]
    lonely = Conversation((Message("user", "hello?"),), name="u.jsonl:1")
    report = ChatReport()
    assert chat_example(lonely, 0, tok, ChatPolicy(), max_len=64,
                        template=template_for(tok), report=report) is None
    assert report.dropped_empty == 1
    with pytest.raises(DataError, match="u.jsonl:1 .* has no supervised token"):
        chat_example(lonely, 0, tok, ChatPolicy(empty="error"), max_len=64,
                     template=template_for(tok))


def test_an_assistant_opening_needs_markers(tokenizers) -> None:
    opening = Conversation((Message("assistant", "Hi!"), Message("user", "Hi.")), name="o:1")
    prefixes, _ = tokenizers["chatml", False]
    with pytest.raises(DataError, match="o:1: template .* opens with an assistant message"):
        owned(prefixes, opening, ChatPolicy())
    markers, directory = tokenizers["chatml", True]
    want_ids, kinds = expected_tokens(directory, [
        ("<|im_start|>assistant\n", "P"), ("Hi!", "C1"), ("<|im_end|>", "E1"), ("\n", "S1"),
        ("<|im_start|>user\nHi.<|im_end|>\n", "P")])
    tokens, got = owned(markers, opening, ChatPolicy())
    assert tokens.tolist() == want_ids
    np.testing.assert_array_equal(got, expected_mask(kinds, "default"))


# Templates that are not prefix-stable: with {% generation %} markers the marks alone
# say what each assistant turn generates (H2), as transformers'
# return_assistant_tokens_mask does; without them ownership cannot be derived.
PHI3_PIECES = [*PIECES["chatml"], ("</s>", "P")]  # EOS closes only the whole conversation
THINKING = Conversation((
    Message("user", "What is 2+2?"),
    Message("assistant", "<think>2 and 2</think>4"),
    Message("user", "And 3+3?"),
    Message("assistant", "<think>3 and 3</think>6, of course."),
), name="think.jsonl:3")
THINKING_PIECES = [  # the earlier answer loses its reasoning once a later turn exists
    ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "P"),
    ("<|im_start|>assistant\n", "P"),
    ("4", "C1"), ("<|im_end|>", "E1"), ("\n", "S1"),
    ("<|im_start|>user\nAnd 3+3?<|im_end|>\n", "P"),
    ("<|im_start|>assistant\n", "P"),
    ("<think>3 and 3</think>6, of course.", "C2"), ("<|im_end|>", "E2"), ("\n", "S2"),
]
UNSTABLE_CASES = [
    ("phi3", PHI3_STYLE_MARKED, CONV, PHI3_PIECES),
    ("phi3-tools", PHI3_STYLE_MARKED, TOOLS, [*TOOL_PIECES, ("</s>", "P")]),
    ("reasoning", REASONING_MARKED, THINKING, THINKING_PIECES),
]


@pytest.mark.parametrize("policy", ["default", "no-eot", "last-turn", "no-tool-calls"])
@pytest.mark.parametrize(("source", "conversation", "pieces"),
                         [case[1:] for case in UNSTABLE_CASES],
                         ids=[case[0] for case in UNSTABLE_CASES])
def test_a_marked_template_that_is_not_prefix_stable_owns_what_its_marks_say(
        tmp_path, source, conversation, pieces, policy) -> None:
    directory = save_tokenizer(tmp_path / "tok", chat_template=source)
    tok = load_hf_tokenizer(directory)
    renders = [template_for(tok).render(conversation.messages[:k], tok).tokens.tolist()
               for k in range(1, len(conversation.messages) + 1)]
    assert any(longer[: len(shorter)] != shorter  # the premise: not prefix-stable
               for shorter, longer in zip(renders, renders[1:], strict=False))
    want_ids, kinds = expected_tokens(directory, pieces)
    tokens, got = owned(tok, conversation, POLICIES[policy][0])
    assert tokens.tolist() == want_ids
    np.testing.assert_array_equal(got, expected_mask(kinds, policy))


def test_negative_control_the_same_template_without_markers_is_refused(tmp_path) -> None:
    tok = load_hf_tokenizer(save_tokenizer(tmp_path / "tok", chat_template=PHI3_STYLE))
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* is not prefix-stable.*"
                                        r"add \{% generation %\} markers"):
        owned(tok, CONV, ChatPolicy())


def test_negative_control_unstable_marks_on_user_turns_are_refused(tmp_path) -> None:
    """Without prefix stability the marks are matched to assistant messages in order:
    a template that also marks its user turns gives four spans for two answers."""
    tok = load_hf_tokenizer(save_tokenizer(tmp_path / "tok", chat_template=PHI3_STYLE_MARKS_USERS))
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* marks 4 generation spans "
                                        r"for 2 assistant messages"):
        owned(tok, CONV, ChatPolicy())


def test_the_prompt_of_a_template_that_is_not_prefix_stable(tmp_path) -> None:
    """The prompt is what the template renders with the generation prompt (no EOS:
    that closes only a finished conversation), its header the assistant's."""
    directory = save_tokenizer(tmp_path / "tok", chat_template=PHI3_STYLE_MARKED)
    tok = load_hf_tokenizer(directory)
    want_ids, _ = expected_tokens(directory, PIECES["chatml"][:8])
    prompt = template_for(tok).render_prompt(CONV.messages[:4], tok)
    assert prompt.tokens.tolist() == want_ids
    header = prompt.message == 4
    assert tok.decode(prompt.tokens[header]) == "<|im_start|>assistant\n"
    assert (prompt.role[header] == Role.ASSISTANT).all()
    assert (prompt.part[header] == Part.HEADER).all()


# --------------------------------------------------------------------------- negative controls


def test_negative_control_a_derivation_off_by_one_fails_the_comparison(tokenizers,
                                                                       monkeypatch) -> None:
    """A deliberately wrong header split (one token short: the header's last token
    counted as the answer) gives a mask the hand-written one refuses."""
    from exactstep.data import hf_chat

    tok, directory = tokenizers["chatml", False]
    _, kinds = expected_tokens(directory, PIECES["chatml"])
    right = hf_chat._Rendering.header_end
    monkeypatch.setattr(hf_chat._Rendering, "header_end",
                        lambda self, *args: right(self, *args) - 1)
    _, got = owned(tok, CONV, ChatPolicy())
    want = expected_mask(kinds, "default")
    assert not np.array_equal(got, want)
    assert np.flatnonzero(got & ~want).size == 2  # the two header newlines


def test_negative_control_a_shifted_mask_fails_the_comparison(tokenizers) -> None:
    tok, directory = tokenizers["gemma", True]
    _, kinds = expected_tokens(directory, PIECES["gemma"])
    _, got = owned(tok, CONV, ChatPolicy())
    want = expected_mask(kinds, "default")
    np.testing.assert_array_equal(got, want)
    for shift in (-1, 1):
        assert not np.array_equal(np.roll(got, shift), want)


def test_negative_control_a_generation_block_one_token_too_wide_is_seen(tmp_path) -> None:
    """With markers the template is the authority: a block opened before the header's
    newline owns that newline too, and the comparison sees exactly that token."""
    wide = jinja(
        "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant"
        "{% generation %}⏎{{ m.content }}<|im_end|>{% endgeneration %}⏎{% else %}"
        "<|im_start|>{{ m.role }}⏎{{ m.content }}<|im_end|>⏎{% endif %}{% endfor %}")
    directory = save_tokenizer(tmp_path / "tok", chat_template=wide)
    tok = load_hf_tokenizer(directory)
    _, kinds = expected_tokens(directory, PIECES["chatml"])
    tokens, got = owned(tok, CONV, ChatPolicy())
    extra = np.flatnonzero(got & ~expected_mask(kinds, "default"))
    assert [tok.token_text(int(tokens[j])) for j in extra] == ["\\n", "\\n"]


def test_negative_control_a_prefix_unstable_template_is_refused(tmp_path) -> None:
    directory = save_tokenizer(tmp_path / "tok", chat_template=UNSTABLE)
    tok = load_hf_tokenizer(directory)
    with pytest.raises(DataError) as caught:
        owned(tok, CONV, ChatPolicy())
    message = str(caught.value)
    assert message.startswith("chat.jsonl:7: template ") and str(directory) in message
    assert "is not prefix-stable: the rendering of the first 1 message" in message
    assert "(token 14: '<|im_end|>' vs '\\n')" in message and "\n" not in message
    assert "add {% generation %} markers" in message


def test_markers_without_prefix_stability_still_need_an_end_of_turn_in_every_turn(
        tmp_path) -> None:
    """With markers prefix stability is not asked for, but the marks' own checks are:
    this template closes only the last turn, so assistant message 2 generates no
    end-of-turn token. Without ``chat.supervise_eot`` the same marks are accepted and
    own the hand-written content."""
    directory = save_tokenizer(tmp_path / "tok", chat_template=UNSTABLE_MARKED)
    tok = load_hf_tokenizer(directory)
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* renders no end-of-turn "
                                        r"token in the generation of assistant message 2"):
        owned(tok, CONV, ChatPolicy())
    want_ids, kinds = expected_tokens(directory, [
        ("<|im_start|>system\nBe brief.\n", "P"), ("<|im_start|>user\nWhat is 2+2?\n", "P"),
        ("<|im_start|>assistant\n", "P"), ("4", "C1"), ("\n", "S1"),
        ("<|im_start|>user\nAnd 3+3?\n", "P"), ("<|im_start|>assistant\n", "P"),
        ("6, of course.", "C2"), ("<|im_end|>", "E2"), ("\n", "S2")])
    tokens, got = owned(tok, CONV, ChatPolicy(supervise_eot=False))
    assert tokens.tolist() == want_ids
    np.testing.assert_array_equal(got, expected_mask(kinds, "no-eot"))


@pytest.mark.parametrize("source", [NO_ASSISTANT, NO_ASSISTANT_MARKED],
                         ids=["prefixes", "markers"])
@pytest.mark.parametrize("empty", ["drop", "error"])
def test_negative_control_a_template_without_assistant_tokens_is_refused(tmp_path, source,
                                                                         empty) -> None:
    """Not an empty example to drop: the template cannot supervise anything."""
    tok = load_hf_tokenizer(save_tokenizer(tmp_path / "tok", chat_template=source))
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* renders no assistant "
                                        r"tokens for message 2"):
        owned(tok, CONV, ChatPolicy(empty=empty))


def test_negative_control_an_end_of_turn_outside_the_generation(tmp_path) -> None:
    directory = save_tokenizer(tmp_path / "tok", chat_template=EOT_OUTSIDE_MARKED)
    tok = load_hf_tokenizer(directory)
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* renders no end-of-turn "
                                        r"token in the generation of assistant message 2.*"
                                        "chat.supervise_eot = false"):
        owned(tok, CONV, ChatPolicy())
    _, kinds = expected_tokens(directory, PIECES["chatml"])
    _, got = owned(tok, CONV, ChatPolicy(supervise_eot=False))
    np.testing.assert_array_equal(got, expected_mask(kinds, "no-eot"))


def test_a_template_that_refuses_a_conversation_is_one_typed_error(tmp_path) -> None:
    strict = jinja("{% for m in messages %}{% if m.role == 'system' %}"
                   "{{ raise_exception('System role not supported') }}{% endif %}"
                   "<|im_start|>{{ m.role }}⏎{{ m.content }}<|im_end|>⏎{% endfor %}")
    tok = load_hf_tokenizer(save_tokenizer(tmp_path / "tok", chat_template=strict))
    with pytest.raises(DataError, match=r"chat.jsonl:7: template .* cannot render the first 1 "
                                        r"message \(TemplateError: System role not supported\)"):
        owned(tok, CONV, ChatPolicy())


def test_marks_on_a_user_message_are_refused(tmp_path) -> None:
    marks_user = jinja("{% for m in messages %}<|im_start|>{{ m.role }}⏎{% generation %}"
                       "{{ m.content }}<|im_end|>{% endgeneration %}⏎{% endfor %}")
    tok = load_hf_tokenizer(save_tokenizer(tmp_path / "tok", chat_template=marks_user))
    with pytest.raises(DataError, match="marks tokens of the system message 0 as assistant"):
        owned(tok, CONV, ChatPolicy())
