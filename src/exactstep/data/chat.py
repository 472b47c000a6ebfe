"""Chat conversations: JSONL loading and the built-in byte-level chat template (R5, S1).

A conversation is rendered exactly once, by a ``ChatRenderer``, which emits the token
ids with each token's role and span; ownership (``rows.chat``) is decided from those
arrays only, never by searching decoded text. ``ChatTemplate`` is the built-in
renderer, ``HFChatTemplate`` (``data.hf_chat``, H2) the Jinja one; ``template_for`` picks.
Design and derivations: docs/design/data.md#datachatpy (R5, S1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from exactstep.data import datasets_source
from exactstep.data.conversation import (
    ROLE_NAMES,
    Conversation,
    Message,
    iter_chat_jsonl,
)
from exactstep.errors import DataError


class Role(IntEnum):
    """Role of a rendered token. ``NONE`` marks the leading BOS, which no message owns."""

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4

    @classmethod
    def of(cls, name: str) -> Role:
        """The role called ``name``; ``DataError`` for anything outside ``ROLE_NAMES``."""
        if name not in ROLE_NAMES:
            raise DataError(f"unknown chat role {name!r}; use one of {', '.join(ROLE_NAMES)}")
        return cls[name.upper()]


class Part(IntEnum):
    """Which part of its message a rendered token belongs to.

    ``SEPARATOR``: tokens a template renders inside an assistant turn after what the
    model generates (e.g. the newline after ``<|im_end|>``); never a target.
    """

    BEGIN = 0
    HEADER = 1
    CONTENT = 2
    TOOL_CALL = 3
    END_OF_TURN = 4
    SEPARATOR = 5


# The parts of an assistant turn that the model generates (R5, H2).
GENERATED_PARTS = (Part.CONTENT, Part.TOOL_CALL, Part.END_OF_TURN)


class ChatTokenizer(Protocol):
    """What the template needs from a tokenizer: text to ids, and two special ids."""

    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class RenderedChat:
    """Parallel per-token arrays of one rendered conversation (R5).

    ``tokens`` int64 [n]; ``role`` int8 [n] (``Role``); ``message`` int32 [n], the
    index of the message a token belongs to (-1, role ``NONE``, for a token no message
    owns: the BOS, and under a marked template that is not prefix-stable every token
    outside its generation marks, ``data.hf_chat``); ``part`` int8 [n] (``Part``).
    Invariant: all four have the same length, and token ``j``'s role and span are
    ``(role[j], message[j], part[j])`` as emitted by the template, never inferred.
    """

    tokens: np.ndarray  # [n] int64
    role: np.ndarray  # [n] int8
    message: np.ndarray  # [n] int32
    part: np.ndarray  # [n] int8

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class ChatRenderer(Protocol):
    """A chat template: renders messages to tokens with each token's role and span.

    ``render`` gives a whole conversation; ``render_prompt`` the earlier messages
    plus the assistant header (what a model answers); ``fingerprint`` is recorded as
    ``representation.template_hash`` (S1). ``render`` raises ``DataError`` (naming
    the template, not the conversation: the caller adds that) when the template
    cannot give the conversation an exact ownership.
    """

    name: str

    def render(self, messages: Sequence[Message], tokenizer: Any) -> RenderedChat: ...

    def render_prompt(self, messages: Sequence[Message], tokenizer: Any) -> RenderedChat: ...

    def fingerprint(self, tokenizer: Any) -> str: ...


@dataclass(frozen=True)
class ChatTemplate:
    """The built-in chat template for the byte tokenizer.

    Renders ``<bos>``, then for each message its header ``<|role|>`` and a newline, its
    content's UTF-8 bytes, ``<|tool_call|>`` + compact sorted-key JSON + a newline per
    tool call, and ``<eos>`` as the end-of-turn marker (docs/design/data.md#datachatpy).

    The fingerprint is the sha256 of the canonical JSON of these fields plus the
    special ids a given tokenizer assigns to BOS and the end-of-turn marker; it goes
    into the manifest as ``representation.template_hash`` (S1).
    """

    name: str = "exactstep-bytes-chat-v1"
    header: str = "<|{role}|>\n"
    tool_call_open: str = "<|tool_call|>"
    tool_call_close: str = "\n"
    begin_token: str = "bos"
    end_of_turn_token: str = "eos"
    tool_call_json: str = "compact,sorted-keys,utf-8"

    def definition(self, tokenizer: ChatTokenizer) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**fields, "bos_id": tokenizer.bos_id, "end_of_turn_id": tokenizer.eos_id}

    def fingerprint(self, tokenizer: ChatTokenizer) -> str:
        canonical = json.dumps(self.definition(tokenizer), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def render(self, messages: Sequence[Message], tokenizer: ChatTokenizer) -> RenderedChat:
        """Render a whole conversation: BOS, then every message ending with end-of-turn."""
        builder = _Builder()
        builder.add([tokenizer.bos_id], Role.NONE, -1, Part.BEGIN)
        for index, message in enumerate(messages):
            self._render_message(builder, index, message, tokenizer)
        return builder.build()

    def render_prompt(
        self, messages: Sequence[Message], tokenizer: ChatTokenizer
    ) -> RenderedChat:
        """Render ``messages`` then the assistant header: the prompt a model answers."""
        builder = _Builder()
        builder.add([tokenizer.bos_id], Role.NONE, -1, Part.BEGIN)
        for index, message in enumerate(messages):
            self._render_message(builder, index, message, tokenizer)
        header = tokenizer.encode(self.header.format(role="assistant"))
        builder.add(header, Role.ASSISTANT, len(messages), Part.HEADER)
        return builder.build()

    def _render_message(
        self, builder: _Builder, index: int, message: Message, tokenizer: ChatTokenizer
    ) -> None:
        role = Role.of(message.role)
        builder.add(tokenizer.encode(self.header.format(role=message.role)), role, index, Part.HEADER)
        builder.add(tokenizer.encode(message.content), role, index, Part.CONTENT)
        for call in message.tool_calls:
            text = self.tool_call_open + call + self.tool_call_close
            builder.add(tokenizer.encode(text), role, index, Part.TOOL_CALL)
        builder.add([tokenizer.eos_id], role, index, Part.END_OF_TURN)


DEFAULT_TEMPLATE = ChatTemplate()


def template_for(tokenizer: Any) -> ChatRenderer:
    """The chat template a run renders with: a Hugging Face tokenizer's own (or
    ``data.chat_template``'s, H2), else the built-in ``DEFAULT_TEMPLATE``.

    Raises ``ConfigError`` for a Hugging Face tokenizer without any chat template.
    """
    own = getattr(tokenizer, "chat_renderer", None)
    return own() if own is not None else DEFAULT_TEMPLATE


@dataclass
class _Builder:
    tokens: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    messages: list[int] = field(default_factory=list)
    parts: list[int] = field(default_factory=list)

    def add(self, ids: Iterable[int], role: Role, message: int, part: Part) -> None:
        ids = list(ids)
        self.tokens.extend(ids)
        self.roles.extend([int(role)] * len(ids))
        self.messages.extend([message] * len(ids))
        self.parts.extend([int(part)] * len(ids))

    def build(self) -> RenderedChat:
        return RenderedChat(
            tokens=np.asarray(self.tokens, dtype=np.int64),
            role=np.asarray(self.roles, dtype=np.int8),
            message=np.asarray(self.messages, dtype=np.int32),
            part=np.asarray(self.parts, dtype=np.int8),
        )


def load_chat_jsonl(path: str | Path, messages_field: str = "messages",
                    columns: tuple[str, ...] = ()) -> list[Conversation]:
    """Read ``{"messages": [...]}`` lines (the key is ``messages_field``); blank lines
    are skipped. A Parquet or Arrow file or a directory of shards is read by
    ``data.datasets_source`` into the same conversations, validated alike.

    A line is ``{"messages": [message, ...], "weight": w}`` (``weight`` optional, a
    finite number ``>= 0``, L3; the declared ``columns`` are kept, each required,
    other top-level keys are ignored); a message is
    ``{"role": "system" | "user" | "assistant" | "tool", "content": "...",
    "tool_calls": [{...}]}``, ``content`` null or absent only for an assistant message
    with tool calls, ``tool_calls`` for assistant messages only; any other message key
    is refused. Lines are strict UTF-8 with no repeated key and no unpaired surrogate,
    and a tool call holds no ``NaN`` or ``Infinity``.

    Raises ``DataError`` naming the file and 1-based line for any malformed line, and
    when the file is missing or holds no conversation.
    """
    path = Path(path)
    if datasets_source.is_dataset_source(path):
        return datasets_source.read_chat_source(path, messages_field, columns)
    conversations = list(iter_chat_jsonl(path, messages_field, columns))
    if not conversations:
        raise DataError(f"chat data file {path} holds no conversation")
    return conversations


