"""JSON Lines input shared by the text and chat loaders: every bad line is named (S1, X4).

``records(path)`` yields a ``Record`` for every non-blank line: its 1-based line
number, ``where`` (``<file>:<line>``, the location every ``DataError`` about that line
starts with) and the decoded JSON value. A UTF-8 byte-order mark at the start of the file is allowed and dropped.

Invariants:

- Bytes are decoded as strict UTF-8. An undecodable line is refused, never repaired:
  a replacement character would silently change the training data and its
  fingerprint.
- ``strict=True`` (the chat loader) refuses a key given twice in one object (which
  value would be meant is ambiguous). The text loader, which reads one field per
  line, keeps Python's lenient parser for whatever else a line carries. ``NaN`` and
  ``Infinity`` still parse (as Python's parser does), so that the field holding one
  is named where it is checked (``weights.parse_weight``, the chat tool calls).
- ``unicode_text`` refuses a string holding an unpaired surrogate (``"\\ud800"`` is
  valid JSON but no Unicode character): it cannot be encoded as UTF-8, so no
  tokenizer could read it.

Failure modes (``DataError``): a file that cannot be read, a line that is not UTF-8,
not JSON, or nested too deeply to parse.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from exactstep.errors import DataError

BOM = "\ufeff"


class Record(NamedTuple):
    """One non-blank line: its number (1-based), ``<file>:<line>`` and its JSON value."""

    number: int
    where: str
    value: Any


def records(path: Path, *, strict: bool = False) -> Iterator[Record]:
    """A ``Record`` for every non-blank line of ``path``, in file order."""
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise DataError(f"data file {path} cannot be read ({exc.strerror}); "
                        "check the path and its permissions") from None
    with fh:
        try:
            for number, raw in enumerate(fh, start=1):
                where = f"{path}:{number}"
                line = decode_line(raw, where)
                if number == 1 and line.startswith(BOM):
                    line = line[len(BOM):]
                if line.strip():
                    yield Record(number, where, parse_line(line, where, strict=strict))
        except OSError as exc:
            raise DataError(f"data file {path} could not be read to the end "
                            f"({exc.strerror})") from None


def decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not valid UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
            "re-encode the file as UTF-8 or remove the line"
        ) from None


def parse_line(line: str, where: str, *, strict: bool) -> Any:
    hooks: dict[str, Any] = {"object_pairs_hook": _unique_keys} if strict else {}
    try:
        return json.loads(line, **hooks)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg}); fix or remove the line") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read; flatten or remove the line") from None
    except _StrictJsonError as exc:
        raise DataError(f"{where}: not valid JSON ({exc}); fix or remove the line") from None


def unicode_text(value: str, where: str, field: str) -> str:
    """``value`` unchanged, or ``DataError`` if it holds an unpaired surrogate."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: {field} holds an unpaired surrogate (\\u{ord(value[exc.start]):04x} at "
            f"index {exc.start}), which is not a Unicode character; fix the escape"
        ) from None
    return value


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type (``null``, ``number``, ``array``, ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


class _StrictJsonError(ValueError):
    """Raised from the parser hooks; turned into the line's ``DataError``."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _StrictJsonError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out
