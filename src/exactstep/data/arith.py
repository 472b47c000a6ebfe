"""A built-in chat SFT demo: multi-turn arithmetic with checkable answers (R5).

``arith_conversations`` deterministically generates conversations such as::

    user:      What is 37+45?
    assistant: 82
    user:      Now multiply that by 3.
    assistant: 246

Every assistant answer is an exact integer, so a model's greedy answer to the LAST
turn of a held-out conversation can be scored by exact match
(``greedy_answer_accuracy``). The train and held-out splits are disjoint: a problem
(its operands and operations, which fix every message) belongs to the held-out split
exactly when a hash of it falls in the held-out bucket, whatever the seed.

``arith_examples`` is the hook a training run calls: conversations compiled to
supervised ``Example``s for training plus the held-out conversations for scoring.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from exactstep.data.chat import (
    DEFAULT_TEMPLATE,
    ChatTemplate,
    ChatTokenizer,
    Conversation,
    Message,
    write_chat_jsonl,
)
from exactstep.errors import ConfigError, DataError
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.chat import ChatPolicy, ChatReport, chat_examples
from exactstep.rows.example import Example

# One held-out bucket out of HOLDOUT_BUCKETS; the hash of a problem picks its bucket.
HOLDOUT_BUCKETS = 10


@dataclass(frozen=True, kw_only=True)
class ArithSpec:
    """The demo's problem family and split sizes (config section ``arith``).

    First turn: ``a + b`` with ``0 <= a, b <= max_operand``. Each of the later turns
    (between ``min_follow_ups`` and ``max_follow_ups`` of them) multiplies the previous
    answer by ``2..max_multiplier`` or adds ``1..max_operand``. ``n_train`` training
    conversations (drawn with replacement) and ``n_heldout`` distinct held-out ones;
    ``max_new_tokens`` bounds each greedy answer at evaluation.
    """

    n_train: int = 20000
    n_heldout: int = 100
    max_operand: int = 9
    max_multiplier: int = 5
    min_follow_ups: int = 1
    max_follow_ups: int = 1
    max_new_tokens: int = 8

    def __post_init__(self) -> None:
        if self.max_operand < 1 or self.max_multiplier < 2:
            raise ConfigError("arith.max_operand must be >= 1 and arith.max_multiplier >= 2")
        if not 0 <= self.min_follow_ups <= self.max_follow_ups:
            raise ConfigError("arith: need 0 <= arith.min_follow_ups <= arith.max_follow_ups")
        if self.n_train < 1 or self.n_heldout < 1 or self.max_new_tokens < 1:
            raise ConfigError("arith.n_train, arith.n_heldout and arith.max_new_tokens must be >= 1")


DEFAULT_SPEC = ArithSpec()

Problem = tuple[int, int, tuple[tuple[str, int], ...]]  # (a, b, ((op, operand), ...))


def _draw_problem(rng: np.random.Generator, spec: ArithSpec) -> Problem:
    a, b = (int(x) for x in rng.integers(0, spec.max_operand + 1, size=2))
    n_follow = int(rng.integers(spec.min_follow_ups, spec.max_follow_ups + 1))
    steps = []
    for _ in range(n_follow):
        if rng.random() < 0.5:
            steps.append(("mul", int(rng.integers(2, spec.max_multiplier + 1))))
        else:
            steps.append(("add", int(rng.integers(1, spec.max_operand + 1))))
    return a, b, tuple(steps)


def _is_heldout(problem: Problem) -> bool:
    digest = hashlib.sha256(repr(problem).encode("ascii")).digest()
    return digest[0] % HOLDOUT_BUCKETS == 0


def _conversation(problem: Problem, name: str) -> Conversation:
    a, b, steps = problem
    value = a + b
    messages = [Message("user", f"What is {a}+{b}?"), Message("assistant", str(value))]
    for op, operand in steps:
        if op == "mul":
            value *= operand
            question = f"Now multiply that by {operand}."
        else:
            value += operand
            question = f"Now add {operand}."
        messages += [Message("user", question), Message("assistant", str(value))]
    return Conversation(messages=tuple(messages), name=name)


def arith_conversations(
    seed: int, n: int, *, split: str, spec: ArithSpec = DEFAULT_SPEC
) -> list[Conversation]:
    """``n`` conversations of ``split`` (``"train"`` or ``"heldout"``), deterministic in ``seed``.

    Train conversations are drawn with replacement from the train problems; held-out
    ones are distinct. Raises ``DataError`` if the problem family has too few
    held-out problems for ``n``.
    """
    if split not in ("train", "heldout"):
        raise ConfigError(f"arith split must be 'train' or 'heldout'; got {split!r}")
    want_heldout = split == "heldout"
    rng = np.random.default_rng([seed, int(want_heldout)])
    seen: set[Problem] = set()
    out: list[Conversation] = []
    budget = 200 * max(n, 1) + 10_000
    while len(out) < n and budget > 0:
        budget -= 1
        problem = _draw_problem(rng, spec)
        if _is_heldout(problem) != want_heldout or (want_heldout and problem in seen):
            continue
        seen.add(problem)
        out.append(_conversation(problem, f"arith:{split}:{len(out)}"))
    if len(out) < n:
        raise DataError(f"arith: could only generate {len(out)} {split} problems; lower the count or widen the spec")
    return out


class ArithData(NamedTuple):
    train_examples: list[Example]
    heldout: list[Conversation]
    report: ChatReport  # what compiling the training conversations did


def arith_examples(
    seed: int,
    n_train: int,
    n_heldout: int,
    tokenizer: ChatTokenizer,
    policy: ChatPolicy,
    *,
    max_len: int,
    spec: ArithSpec = DEFAULT_SPEC,
    template: ChatTemplate = DEFAULT_TEMPLATE,
) -> ArithData:
    """The demo's data hook: training ``Example``s, held-out conversations, chat report."""
    train = arith_conversations(seed, n_train, split="train", spec=spec)
    heldout = arith_conversations(seed, n_heldout, split="heldout", spec=spec)
    examples, report = chat_examples(train, tokenizer, policy, max_len=max_len, template=template)
    return ArithData(examples, heldout, report)


def write_arith_jsonl(path: str, seed: int, n: int, *, split: str, spec: ArithSpec = DEFAULT_SPEC) -> None:
    """Write ``n`` generated conversations of ``split`` as chat JSONL, for reading or reuse."""
    write_chat_jsonl(arith_conversations(seed, n, split=split, spec=spec), path)


class DecoderLike(Protocol):
    def __call__(self, batch: Batch) -> torch.Tensor: ...  # [B, T, H] (runs forward)
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [B, T, V]


def last_turn_prompt(conversation: Conversation) -> tuple[list[Message], str]:
    """Messages before the last assistant turn, and that turn's expected content."""
    for index in range(len(conversation.messages) - 1, -1, -1):
        if conversation.messages[index].role == "assistant":
            return list(conversation.messages[:index]), conversation.messages[index].content
    raise DataError(f"{conversation.name or 'conversation'} has no assistant turn to score")


def single_segment_batch(prompts: torch.Tensor) -> Batch:
    """A batch of ``G`` equal-length prompts, one segment each, positions ``0..L-1``."""
    rows, length = prompts.shape  # [G, L]
    positions = torch.arange(length, dtype=torch.int64).expand(rows, length)
    segment = (Segment(example_id=0, piece=0, offset=0, start=0, length=length),)
    return Batch(
        input_ids=prompts,
        labels=torch.full_like(prompts, IGNORE_INDEX),
        position_ids=positions.to(prompts.device),
        segment_ids=torch.ones(rows, length, dtype=torch.int32, device=prompts.device),
        segments=tuple(segment for _ in range(rows)),
    )


@torch.no_grad()
def _greedy_continue(
    model: DecoderLike, prompts: torch.Tensor, eos_id: int, max_new_tokens: int
) -> list[list[int]]:
    """Greedy decoding without a KV cache; each list stops before its first EOS."""
    tokens = prompts  # [G, L]
    finished = torch.zeros(prompts.shape[0], dtype=torch.bool, device=prompts.device)
    for _ in range(max_new_tokens):
        hidden = model(single_segment_batch(tokens))  # [G, L', H]
        next_ids = model.logits(hidden[:, -1:, :])[:, -1, :].argmax(dim=-1)  # [G]
        next_ids = torch.where(finished, torch.full_like(next_ids, eos_id), next_ids)
        tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
        finished |= next_ids == eos_id
        if bool(finished.all()):
            break
    generated = tokens[:, prompts.shape[1]:].tolist()
    return [row[: row.index(eos_id)] if eos_id in row else row + [-1] for row in generated]


def greedy_answer_accuracy(
    model: DecoderLike,
    tokenizer: ChatTokenizer,
    conversations: Sequence[Conversation],
    *,
    device: torch.device | str,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    template: ChatTemplate = DEFAULT_TEMPLATE,
) -> float:
    """Exact-match accuracy of greedy answers to each conversation's LAST assistant turn.

    The prompt is every earlier message plus the assistant header; an answer counts
    only if the model emits exactly the expected tokens and then the end-of-turn
    marker within ``max_new_tokens``. Runs in eval mode under ``no_grad`` and restores
    the model's previous mode (E1). Raises ``DataError`` on an empty set.
    """
    if not conversations:
        raise DataError("greedy_answer_accuracy needs at least one held-out conversation")
    by_length: dict[int, list[tuple[list[int], list[int]]]] = {}
    for conversation in conversations:
        messages, expected = last_turn_prompt(conversation)
        prompt = template.render_prompt(messages, tokenizer).tokens.tolist()
        by_length.setdefault(len(prompt), []).append((prompt, tokenizer.encode(expected)))
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        correct = 0
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                chunk = group[start : start + batch_size]
                prompts = torch.tensor([p for p, _ in chunk], dtype=torch.int64, device=device)
                answers = _greedy_continue(model, prompts, tokenizer.eos_id, max_new_tokens)
                correct += sum(got == want for got, (_, want) in zip(answers, chunk, strict=True))
    finally:
        if hasattr(model, "train"):
            model.train(was_training)
    return correct / len(conversations)
