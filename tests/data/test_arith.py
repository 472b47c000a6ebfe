"""The built-in arithmetic chat demo: generator, split, and greedy exact match (R5, E1)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from exactstep.data.arith import (
    ArithSpec,
    arith_conversations,
    last_turn_prompt,
    write_arith_jsonl,
)
from exactstep.data.chat import DEFAULT_TEMPLATE, load_chat_jsonl
from exactstep.data.conversation import Conversation
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError, DataError
from exactstep.eval import greedy_answer_accuracy
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import Batch
from exactstep.rows.chat import ChatPolicy, chat_examples

TOK = ByteTokenizer()
SPEC = ArithSpec(max_operand=30, max_multiplier=9, min_follow_ups=1, max_follow_ups=3)


def contents(conversations: list[Conversation]) -> list[tuple[str, ...]]:
    return [tuple(m.content for m in c.messages) for c in conversations]


def recompute(conversation: Conversation) -> list[int]:
    """Answers derived from the user questions alone, by an independent parser."""
    value = None
    answers = []
    for m in conversation.messages:
        if m.role != "user":
            continue
        if match := re.fullmatch(r"What is (\d+)\+(\d+)\?", m.content):
            value = int(match[1]) + int(match[2])
        elif match := re.fullmatch(r"Now multiply that by (\d+)\.", m.content):
            value *= int(match[1])
        elif match := re.fullmatch(r"Now add (\d+)\.", m.content):
            value += int(match[1])
        else:
            raise AssertionError(f"unexpected question {m.content!r}")
        answers.append(value)
    return answers


def test_generator_is_deterministic_in_the_seed():
    assert contents(arith_conversations(3, 50, split="train", spec=SPEC)) == \
        contents(arith_conversations(3, 50, split="train", spec=SPEC))
    assert contents(arith_conversations(3, 50, split="train", spec=SPEC)) != \
        contents(arith_conversations(4, 50, split="train", spec=SPEC))


def test_every_answer_is_the_checkable_value_of_its_questions():
    for conversation in arith_conversations(0, 300, split="train", spec=SPEC):
        roles = [m.role for m in conversation.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        got = [int(m.content) for m in conversation.messages if m.role == "assistant"]
        assert got == recompute(conversation)


def test_train_and_heldout_are_disjoint_and_heldout_is_distinct():
    train = set(contents(arith_conversations(0, 3000, split="train", spec=SPEC)))
    train |= set(contents(arith_conversations(1, 3000, split="train", spec=SPEC)))
    heldout = contents(arith_conversations(0, 200, split="heldout", spec=SPEC))
    assert len(set(heldout)) == len(heldout) == 200
    assert not train & set(heldout)


def test_a_family_too_small_for_the_heldout_count_is_a_data_error():
    tiny = ArithSpec(max_operand=1, max_multiplier=2, min_follow_ups=0, max_follow_ups=0)
    with pytest.raises(DataError, match="could only generate"):
        arith_conversations(0, 50, split="heldout", spec=tiny)


def test_spec_rejects_invalid_values():
    with pytest.raises(ConfigError):
        ArithSpec(max_multiplier=1)
    with pytest.raises(ConfigError):
        ArithSpec(min_follow_ups=3, max_follow_ups=1)


def test_examples_own_exactly_the_answers_and_their_end_of_turn():
    train = arith_conversations(0, 20, split="train", spec=SPEC)
    examples, report = chat_examples(train, TOK, ChatPolicy(), max_len=512)
    assert len(examples) == 20
    for example, conversation in zip(examples, train, strict=True):
        owned = TOK.decode(example.tokens[example.owned])
        expected = "".join(m.content + "<eos>" for m in conversation.messages if m.role == "assistant")
        assert owned == expected
    # every answer byte and its end-of-turn marker, counted from the conversations
    answers = [m.content for c in train for m in c.messages if m.role == "assistant"]
    assert report.supervised_targets == sum(len(a.encode()) + 1 for a in answers)


def test_jsonl_writer_round_trips(tmp_path):
    path = tmp_path / "arith.jsonl"
    write_arith_jsonl(str(path), 0, 10, split="heldout", spec=SPEC)
    assert contents(load_chat_jsonl(path)) == contents(arith_conversations(0, 10, split="heldout", spec=SPEC))


# --------------------------------------------------------------------------- greedy exact match


class ScriptedModel(nn.Module):
    """Answers each known prompt with a scripted continuation, one greedy token at a time.

    ``forward`` returns one-hot "hidden states" over the vocabulary so that
    ``logits`` is the identity; it records whether it was called in eval mode.
    """

    def __init__(self, script: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__()
        self.script = script
        self.prompt_lengths = sorted({len(k) for k in script}, reverse=True)
        self.calls_in_train_mode = 0

    def forward(self, batch: Batch) -> torch.Tensor:
        self.calls_in_train_mode += int(self.training)
        rows, length = batch.input_ids.shape
        hidden = torch.zeros(rows, length, TOK.vocab_size)  # [G, L, V]
        for r, row in enumerate(batch.input_ids.tolist()):
            for n in self.prompt_lengths:
                if n <= length and tuple(row[:n]) in self.script:
                    continuation = self.script[tuple(row[:n])]
                    produced = length - n
                    next_id = continuation[produced] if produced < len(continuation) else TOK.eos_id
                    hidden[r, -1, next_id] = 1.0
                    break
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def script_for(conversations, answer_of) -> dict[tuple[int, ...], list[int]]:
    script = {}
    for c in conversations:
        messages, expected = last_turn_prompt(c)
        prompt = tuple(DEFAULT_TEMPLATE.render_prompt(messages, TOK).tokens.tolist())
        script[prompt] = answer_of(expected)
    return script


HELDOUT = arith_conversations(0, 40, split="heldout", spec=SPEC)


def test_exact_answers_score_one_and_mode_is_restored():
    model = ScriptedModel(script_for(HELDOUT, lambda e: TOK.encode(e) + [TOK.eos_id]))
    model.train()
    assert greedy_answer_accuracy(model, TOK, HELDOUT, device="cpu", batch_size=7) == 1.0
    assert model.training and model.calls_in_train_mode == 0


def test_wrong_answers_score_zero_negative_control():
    wrong = ScriptedModel(script_for(HELDOUT, lambda e: TOK.encode(str(int(e) + 1)) + [TOK.eos_id]))
    assert greedy_answer_accuracy(wrong, TOK, HELDOUT, device="cpu") == 0.0


def test_an_answer_that_never_ends_its_turn_does_not_count():
    rambling = ScriptedModel(script_for(HELDOUT, lambda e: TOK.encode(e + "0000000000")))
    assert greedy_answer_accuracy(rambling, TOK, HELDOUT, device="cpu", max_new_tokens=6) == 0.0
    prefix_only = ScriptedModel(script_for(HELDOUT, lambda e: TOK.encode(e)[:-1] + [TOK.eos_id]))
    assert greedy_answer_accuracy(prefix_only, TOK, HELDOUT, device="cpu") == 0.0


def test_accuracy_is_the_exact_fraction_of_correct_conversations():
    correct = set(range(0, 40, 4))  # 10 of 40
    script = {}
    for k, c in enumerate(HELDOUT):
        answer = last_turn_prompt(c)[1] if k in correct else "x"
        script |= script_for([c], lambda e, a=answer: TOK.encode(a) + [TOK.eos_id])
    assert greedy_answer_accuracy(ScriptedModel(script), TOK, HELDOUT, device="cpu") == 0.25


def test_runs_on_the_built_in_decoder_and_restores_its_mode():
    cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32)
    model = build_model(cfg, TOK.vocab_size, seed=0)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    accuracy = greedy_answer_accuracy(model, TOK, HELDOUT[:4], device="cpu", max_new_tokens=2)
    assert 0.0 <= accuracy <= 1.0 and model.training
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_empty_heldout_set_is_a_data_error():
    with pytest.raises(DataError):
        greedy_answer_accuracy(ScriptedModel({}), TOK, [], device="cpu")
