"""JSON Lines input shared by the text and chat loaders: every bad line is named (S1, X4).

``records(path)`` yields each non-blank line's number, ``<file>:<line>`` and decoded
JSON value; every ``DataError`` about a line starts with that location. Bytes are
strict UTF-8, refused rather than repaired.
Design and derivations: docs/design/data.md#datajsonlpy (S1, X4).
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
    """A ``Record`` for every non-blank line of ``path``, in file order.

    A leading UTF-8 byte-order mark is dropped. ``DataError`` (starting with
    ``<file>:<line>``) for an unreadable file, a line that is not strict UTF-8 (never
    repaired), not JSON or nested too deeply; ``strict=True`` also refuses a key given
    twice in one object.
    """
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


def declared_columns(record: object, where: str, columns: tuple[str, ...]
                     ) -> dict[str, Any] | None:
    """The values of the declared ``columns`` (``data.columns``) of one decoded line,
    in their declared order, or ``None`` when none are declared; ``DataError`` naming
    the line and the column when one is absent."""
    if not columns:
        return None
    out = {}
    for name in columns:
        if not isinstance(record, dict) or name not in record:
            raise DataError(f'{where}: no "{name}" field, which data.columns declares; give '
                            "every line that field or remove it from data.columns")
        out[name] = record[name]
    return out


class _StrictJsonError(ValueError):
    """Raised from the parser hooks; turned into the line's ``DataError``."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _StrictJsonError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out
