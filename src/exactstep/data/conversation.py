"""A chat conversation as data (R5): messages, their JSONL shape and its validation.

``Conversation`` and ``Message`` are what every chat source yields (JSONL here,
Parquet/Arrow through ``data.datasets_source``); ``parse_conversation`` is the one
validation of a decoded record, so every source refuses the same lines alike. The
shape of a line is documented in ``data.chat``, which renders conversations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactstep.data.jsonl import declared_columns, json_type, records, unicode_text
from exactstep.data.weights import parse_weight
from exactstep.errors import DataError

ROLE_NAMES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "tool_calls")



@dataclass(frozen=True)
class Message:
    """One chat message. ``tool_calls`` holds canonical JSON strings (assistant only)."""

    role: str
    content: str
    tool_calls: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [json.loads(call) for call in self.tool_calls]
        return out


@dataclass(frozen=True)
class Conversation:
    """An ordered, non-empty tuple of messages; ``name`` says where it came from;
    ``weight`` is the conversation's L3 weight (``None`` when the source gives none)."""

    messages: tuple[Message, ...]
    name: str = ""
    weight: float | None = None
    columns: dict[str, Any] | None = None  # the declared extra columns (data.columns)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"messages": [m.to_json() for m in self.messages]}
        if self.weight is not None:
            out["weight"] = self.weight
        return out


def canonical_tool_call(call: Any) -> str:
    """The canonical JSON text of one tool call (compact, sorted keys, UTF-8)."""
    return json.dumps(call, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def parse_conversation(obj: Any, where: str, field: str = "messages",
                       columns: tuple[str, ...] = ()) -> Conversation:
    """Validate one decoded JSON object whose ``field`` holds the messages; ``where``
    (e.g. ``file.jsonl:3``) names it in errors."""
    if not isinstance(obj, dict) or field not in obj:
        got = "an object without it" if isinstance(obj, dict) else f"a JSON {json_type(obj)}"
        raise DataError(f'{where}: expected an object with a "{field}" list, got {got}')
    raw = obj[field]
    if not isinstance(raw, list) or not raw:
        got = "an empty array" if isinstance(raw, list) else f"a JSON {json_type(raw)}"
        raise DataError(f'{where}: "{field}" must be a non-empty list of messages, got {got}')
    messages = tuple(_parse_message(m, f"{where}: message {k}") for k, m in enumerate(raw))
    return Conversation(messages=messages, name=where, weight=parse_weight(obj, where),
                        columns=declared_columns(obj, where, columns))


def _parse_message(raw: Any, where: str) -> Message:
    if not isinstance(raw, dict):
        raise DataError(
            f'{where} must be an object with "role" and "content", got a JSON {json_type(raw)}'
        )
    unknown = sorted(set(raw) - set(MESSAGE_KEYS))
    if unknown:
        raise DataError(f"{where} has unknown key {unknown[0]!r}; a message holds only "
                        f"{', '.join(MESSAGE_KEYS)}")
    role = raw.get("role")
    if "role" not in raw:
        raise DataError(f'{where}: "role" is missing; give it one of {", ".join(ROLE_NAMES)}')
    if role not in ROLE_NAMES:
        raise DataError(f"{where} has unknown role {role!r}; use one of {', '.join(ROLE_NAMES)}")
    calls = _parse_tool_calls(raw.get("tool_calls"), role, where)
    content = raw.get("content")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        what = ("is missing" if content is None
                else f"is not a string (got a JSON {json_type(content)})")
        raise DataError(f'{where} ({role}): "content" {what}; give it a string')
    return Message(role=role, content=unicode_text(content, where, '"content"'),
                   tool_calls=calls)


def _parse_tool_calls(raw: Any, role: str, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if role != "assistant":
        raise DataError(f'{where} ({role}): only assistant messages may carry "tool_calls"')
    if not isinstance(raw, list):
        raise DataError(
            f'{where}: "tool_calls" must be a list of JSON objects, got a JSON {json_type(raw)}'
        )
    for index, call in enumerate(raw):
        if not isinstance(call, dict):
            raise DataError(f'{where}: "tool_calls" item {index} must be a JSON object '
                            f"(e.g. {{\"name\": ..., \"arguments\": ...}}), got a JSON "
                            f"{json_type(call)}")
        try:
            json.dumps(call, allow_nan=False)
        except ValueError:
            raise DataError(f'{where}: "tool_calls" item {index} holds NaN or Infinity, '
                            "which JSON has no value for; give a finite number") from None
    return tuple(
        unicode_text(canonical_tool_call(call), where, f'"tool_calls" item {index}')
        for index, call in enumerate(raw)
    )


def iter_chat_jsonl(path: str | Path, messages_field: str = "messages",
                    columns: tuple[str, ...] = ()) -> Iterator[Conversation]:
    """``load_chat_jsonl``'s conversations one line at a time (the file is checked
    before the first); the caller counts them."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"chat data file {path} {what}; point data.source at a .jsonl file")
    return (parse_conversation(line.value, line.where, messages_field, columns)
            for line in records(path, strict=True))


def write_chat_jsonl(conversations: Iterable[Conversation], path: str | Path) -> Path:
    """Write conversations as ``{"messages": [...]}`` lines that ``load_chat_jsonl`` reads back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for conversation in conversations:
            fh.write(json.dumps(conversation.to_json(), ensure_ascii=False) + "\n")
    return path
