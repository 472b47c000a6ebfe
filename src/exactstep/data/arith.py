"""A built-in chat SFT demo: multi-turn arithmetic with checkable answers (R5).

``arith_conversations`` generates the conversations deterministically, with train and
held-out splits that never share a problem; a model's greedy answer to the last turn of
a held-out conversation is scored by exact match (``exactstep.eval``), and
``exactstep.rows.sources`` compiles the conversations into examples for a run.
Design and derivations: docs/design/data.md#dataarithpy (R5).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from exactstep.data.conversation import Conversation, Message, write_chat_jsonl
from exactstep.errors import ConfigError, DataError
from exactstep.ranges import at_least, check

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
        for name in ("n_train", "n_heldout", "max_operand", "max_new_tokens"):
            check(f"arith.{name}", getattr(self, name), at_least(1))
        check("arith.max_multiplier", self.max_multiplier, at_least(2))
        check("arith.min_follow_ups", self.min_follow_ups, at_least(0))
        if self.max_follow_ups < self.min_follow_ups:
            raise ConfigError(
                f"arith.max_follow_ups must be >= arith.min_follow_ups ({self.min_follow_ups}); "
                f"got {self.max_follow_ups}"
            )


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
    ones are distinct. A problem is held out exactly when its hash falls in the
    held-out bucket, whatever the seed, so the splits never share a problem. Raises
    ``DataError`` if the problem family has too few held-out problems for ``n``.
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


def write_arith_jsonl(path: str, seed: int, n: int, *, split: str, spec: ArithSpec = DEFAULT_SPEC) -> None:
    """Write ``n`` generated conversations of ``split`` as chat JSONL, for reading or reuse."""
    write_chat_jsonl(arith_conversations(seed, n, split=split, spec=spec), path)


def last_turn_prompt(conversation: Conversation) -> tuple[list[Message], str]:
    """Messages before the last assistant turn, and that turn's expected content."""
    for index in range(len(conversation.messages) - 1, -1, -1):
        if conversation.messages[index].role == "assistant":
            return list(conversation.messages[:index]), conversation.messages[index].content
    raise DataError(f"{conversation.name or 'conversation'} has no assistant turn to score")
