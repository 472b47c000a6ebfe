"""Chat SFT ownership: from rendered conversations to supervised ``Example``s (R5).

Ownership is decided on target tokens from the template's role/span arrays, never
from decoded text; the collator's shift then gives row ownership ``l_i = a_(i+1)``.
``ChatPolicy`` says which assistant tokens are targets; each rendering is checked
against it (H2) and truncated, and empty conversations are dropped or refused.
Design and derivations: docs/design/rows.md#rowschatpy (R5, R2, H2, R4).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from exactstep.data.chat import (
    DEFAULT_TEMPLATE,
    GENERATED_PARTS,
    ChatRenderer,
    ChatTokenizer,
    Part,
    RenderedChat,
    Role,
)
from exactstep.data.conversation import Conversation
from exactstep.errors import ConfigError, DataError
from exactstep.rows.example import Example


@dataclass(frozen=True, kw_only=True)
class ChatPolicy:
    """Which assistant tokens are supervised targets (R5).

    ``turns``: ``all`` assistant messages, or only the ``last`` one of the
    conversation. ``supervise_eot``: the assistant's end-of-turn marker is a target
    (teaches the model to stop). ``supervise_tool_calls``: the assistant's tool-call
    spans are targets. ``empty``: a conversation with no supervised target (after
    truncation) is dropped and counted (``drop``) or raises ``DataError`` (``error``).
    """

    turns: Literal["all", "last"] = "all"
    supervise_eot: bool = True
    supervise_tool_calls: bool = True
    empty: Literal["drop", "error"] = "drop"

    def __post_init__(self) -> None:
        if self.turns not in ("all", "last"):
            raise ConfigError(f"chat.turns must be 'all' or 'last'; got {self.turns!r}")
        if self.empty not in ("drop", "error"):
            raise ConfigError(f"chat.empty must be 'drop' or 'error'; got {self.empty!r}")

    def supervised_parts(self) -> tuple[Part, ...]:
        parts = [Part.CONTENT]
        if self.supervise_tool_calls:
            parts.append(Part.TOOL_CALL)
        if self.supervise_eot:
            parts.append(Part.END_OF_TURN)
        return tuple(parts)


def target_ownership(rendered: RenderedChat, policy: ChatPolicy) -> np.ndarray:
    """``a_j`` for every rendered token: bool [n].

    True only for assistant tokens whose part the policy supervises, in a selected
    turn. Headers and the BOS are never owned; nor is any system, user or tool token.
    """
    owned = (rendered.role == Role.ASSISTANT) & np.isin(
        rendered.part, [int(p) for p in policy.supervised_parts()]
    )
    if policy.turns == "last":
        assistant_messages = rendered.message[rendered.role == Role.ASSISTANT]
        if assistant_messages.size:
            owned &= rendered.message == assistant_messages.max()
    return owned


def selected_turns(conversation: Conversation, policy: ChatPolicy) -> list[int]:
    """Message indices of the assistant turns the policy supervises (``chat.turns``)."""
    turns = [k for k, m in enumerate(conversation.messages) if m.role == "assistant"]
    return turns if policy.turns == "all" else turns[-1:]


def check_rendered(rendered: RenderedChat, conversation: Conversation, policy: ChatPolicy,
                   *, where: str, template: str) -> None:
    """Refuse a rendering whose ownership cannot be what the policy declares (H2).

    Each assistant message the policy selects must have a generated token in the
    rendering (content, tool call or end-of-turn), and under ``supervise_eot`` an
    end-of-turn token. Raises ``DataError`` naming ``where`` and ``template``.
    """
    generated = np.isin(rendered.part, [int(p) for p in GENERATED_PARTS])
    for k in selected_turns(conversation, policy):
        turn = (rendered.message == k) & (rendered.role == Role.ASSISTANT)
        if not (turn & generated).any():
            raise DataError(
                f"{where}: template {template} renders no assistant tokens for message {k} "
                "(nothing the model would generate: no content, tool call or end-of-turn "
                "token); fix the template (its {% generation %} block, or the assistant "
                "turn it renders)")
        if policy.supervise_eot and not (turn & (rendered.part == Part.END_OF_TURN)).any():
            raise DataError(
                f"{where}: template {template} renders no end-of-turn token in the generation "
                f"of assistant message {k} (a special token ending the turn, inside its "
                "{% generation %} block if it has one); end the assistant turn with one, or "
                "set chat.supervise_eot = false")


def row_ownership(target_owned: np.ndarray) -> np.ndarray:
    """``l_i = a_(i+1)``: bool [n]; the last row has no next token and owns nothing."""
    rows = np.zeros_like(target_owned, dtype=bool)
    rows[:-1] = target_owned[1:]
    return rows


@dataclass
class ChatReport:
    """Counts of what chat compilation did (R4/R5 outcomes, for the data report).

    ``truncated``: conversations cut to ``max_len``; ``tokens_cut`` and
    ``targets_cut``: tokens and supervised targets lost to truncation (kept examples
    only); ``dropped_empty``: conversations with no supervised target, dropped;
    ``supervised_targets``: owned targets in the kept examples (each is one supervised
    row after the shift, because position 0 is never owned).
    """

    conversations: int = 0
    kept: int = 0
    truncated: int = 0
    tokens_cut: int = 0
    targets_cut: int = 0
    dropped_empty: int = 0
    supervised_targets: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def chat_example(
    conversation: Conversation,
    example_id: int,
    tokenizer: ChatTokenizer,
    policy: ChatPolicy,
    *,
    max_len: int,
    template: ChatRenderer = DEFAULT_TEMPLATE,
    report: ChatReport | None = None,
) -> Example | None:
    """Render, check, own and truncate one conversation.

    A rendering the template refuses, or that ``check_rendered`` refuses, is a
    ``DataError`` naming the conversation and the template (H2). Keeps the first
    ``max_len`` tokens (a row of ``max_len`` columns then holds the whole example,
    every kept target with its predecessor row). The conversation's ``weight`` (L3)
    becomes the example's. Returns ``None`` when no supervised target remains and
    ``policy.empty == "drop"``; raises ``DataError`` naming the conversation when
    ``policy.empty == "error"``.
    """
    if max_len < 2:
        raise ConfigError(f"chat max_len must be >= 2 (a target needs a row before it); got {max_len}")
    report = report if report is not None else ChatReport()
    report.conversations += 1
    where = conversation.name or f"conversation {example_id}"
    try:
        rendered = template.render(conversation.messages, tokenizer)
    except DataError as exc:
        raise DataError(f"{where}: {exc}") from None
    check_rendered(rendered, conversation, policy, where=where, template=template.name)
    owned = target_ownership(rendered, policy)
    owned[0] = False  # no row precedes token 0, so it can never be a target
    tokens = rendered.tokens
    cut_tokens = max(0, len(tokens) - max_len)
    cut_targets = int(owned[max_len:].sum())
    tokens, owned = tokens[:max_len], owned[:max_len]
    if not owned.any():
        return _empty(conversation, example_id, policy, report, truncated=cut_tokens > 0)
    report.kept += 1
    report.truncated += int(cut_tokens > 0)
    report.tokens_cut += cut_tokens
    report.targets_cut += cut_targets
    report.supervised_targets += int(owned.sum())
    report.tokens += int(tokens.shape[0])
    return Example(
        example_id=example_id, tokens=tokens.copy(), owned=owned.copy(), weight=conversation.weight,
        columns=conversation.columns,
    )


def _empty(
    conversation: Conversation,
    example_id: int,
    policy: ChatPolicy,
    report: ChatReport,
    *,
    truncated: bool,
) -> None:
    name = conversation.name or f"conversation {example_id}"
    if policy.empty == "error":
        why = "after truncation to the row length" if truncated else "under the chat policy"
        raise DataError(
            f"{name} (example {example_id}) has no supervised token {why}; "
            "raise batch.seq_len, shorten the conversation, or set chat.empty = 'drop'"
        )
    report.dropped_empty += 1
    return None


def chat_examples(
    conversations: Sequence[Conversation],
    tokenizer: ChatTokenizer,
    policy: ChatPolicy,
    *,
    max_len: int,
    template: ChatRenderer = DEFAULT_TEMPLATE,
) -> tuple[list[Example], ChatReport]:
    """Compile conversations to ``Example``s; ``example_id`` is the index in ``conversations``.

    Dropped conversations keep their index unused, so an example id always names
    the same source conversation (R6).
    """
    report = ChatReport()
    examples = []
    for index, conversation in enumerate(conversations):
        example = chat_example(
            conversation, index, tokenizer, policy,
            max_len=max_len, template=template, report=report,
        )
        if example is not None:
            examples.append(example)
    return examples, report
