"""Chat conversations: JSONL loading and the built-in byte-level chat template (R5, S1).

A conversation is rendered exactly once, by a ``ChatRenderer``'s ``render``, which
emits the token ids together with each token's role and span (message index and
part). Target ownership (``exactstep.rows.chat``) is decided from those parallel
arrays only; no code path ever searches decoded text for role markers. Two renderers
exist: ``ChatTemplate`` (the built-in one, below) and ``HFChatTemplate`` (a Hugging
Face Jinja template, ``exactstep.data.hf_chat``, H2); ``template_for(tokenizer)``
picks the one a run uses.

The built-in template (``exactstep-bytes-chat-v1``), for the byte tokenizer::

    <bos>                                   part BEGIN, role NONE, message -1
    for each message m (index k):
        "<|" + role + "|>\n"                part HEADER
        content (UTF-8 bytes)               part CONTENT
        for each tool call c of an assistant message:
            "<|tool_call|>" + json(c) + "\n"  part TOOL_CALL
        <eos>                               part END_OF_TURN (the end-of-turn marker)

``json(c)`` is compact JSON with sorted keys, so a tool call renders the same bytes
whatever key order the source file used. A generation prompt is the rendering of the
earlier messages followed by the assistant header; the model then answers and ends
its turn with ``<eos>``.

The shape of a line (anything else is a ``DataError`` naming ``<file>:<line>``, the
message and the expected shape)::

    {"messages": [message, ...],        a non-empty array
     "weight": w}                       optional (L3): a finite number >= 0; part of the
                                        conversation's JSON (so of the data fingerprint);
                                        other top-level keys are ignored
    message = {"role": ROLE,            one of system, user, assistant, tool
               "content": "...",        a string; null or absent only for an assistant
                                        message with at least one tool call
               "tool_calls": [{...}]}   assistant only: an array of JSON objects

A message key outside ``role``, ``content`` and ``tool_calls`` is refused rather than
ignored: the template renders exactly these, so anything else would silently fall
out of the training data. Lines are strict UTF-8 with no key repeated in an object
(``exactstep.data.jsonl``), no string may hold an unpaired surrogate, and a tool call
may hold no ``NaN`` or ``Infinity`` (its rendering must be JSON).
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
    """The built-in chat template for the byte tokenizer (see the module docstring).

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


def load_chat_jsonl(path: str | Path, messages_field: str = "messages") -> list[Conversation]:
    """Read ``{"messages": [...]}`` lines (the key is ``messages_field``); blank lines
    are skipped. A Parquet or Arrow file or a directory of shards is read by
    ``data.datasets_source`` into the same conversations, validated alike.

    Raises ``DataError`` naming the file and 1-based line for any malformed line (see
    the module docstring for the shape), and when the file is missing or holds no
    conversation.
    """
    path = Path(path)
    if datasets_source.is_dataset_source(path):
        return datasets_source.read_chat_source(path, messages_field)
    conversations = list(iter_chat_jsonl(path, messages_field))
    if not conversations:
        raise DataError(f"chat data file {path} holds no conversation")
    return conversations


