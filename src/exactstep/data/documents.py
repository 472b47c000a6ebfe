"""Text documents and the JSONL text reader (S1, L3).

A ``Document`` is one named text with its optional weight; every text source yields
them (JSONL here, Parquet/Arrow through ``data.datasets_source``), and ``data.corpus``
splits and fingerprints them. Lines are strict UTF-8 (``data.jsonl``); a bad line is a
``DataError`` naming ``<file>:<line>``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exactstep.data.jsonl import declared_columns, json_type, records, unicode_text
from exactstep.data.weights import parse_weight
from exactstep.errors import DataError


@dataclass(frozen=True)
class Document:
    """One document: a stable ``name`` (used for the split), its ``text`` and, when the
    source gives one, its ``weight`` (L3; ``None`` when absent)."""

    name: str
    text: str
    weight: float | None = None
    columns: dict[str, Any] | None = None  # the declared extra columns (data.columns)



def read_jsonl(path: Path, field: str = "text", label: str | None = None,
               columns: tuple[str, ...] = ()) -> list[Document]:
    """Documents from ``{field: str}`` lines (optional ``"weight"``, L3), named
    ``<label>:<line>`` (``label`` defaults to the file name); blank lines skipped.

    Lines are strict UTF-8 (``data.jsonl``); the declared ``columns`` are kept (each
    line must have them), other keys of a line are ignored.
    """
    return list(iter_jsonl(path, field, label, columns))


def iter_jsonl(path: Path, field: str = "text", label: str | None = None,
               columns: tuple[str, ...] = ()) -> Iterator[Document]:
    """``read_jsonl`` one document at a time (the file is checked before the first)."""
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(
            f"data file {path} {what}; set data.source to 'stdlib' or an existing .jsonl file"
        )
    return _documents_of(path, field, path.name if label is None else label, columns)


def _documents_of(path: Path, field: str, label: str, columns: tuple[str, ...]
                  ) -> Iterator[Document]:
    for line in records(path):
        text, weight = text_of(line.value, line.where, field)
        yield Document(name=f"{label}:{line.number}", text=text, weight=weight,
                       columns=declared_columns(line.value, line.where, columns))


def text_of(record: object, where: str, field: str = "text") -> tuple[str, float | None]:
    """The ``field`` string of one decoded line and its optional ``"weight"``
    (validated, L3); ``where`` is ``<file>:<line>``."""
    if not isinstance(record, dict) or field not in record:
        got = "an object" if isinstance(record, dict) else f"a JSON {json_type(record)}"
        raise DataError(
            f'{where}: no "{field}" field (the line is {got}); each line must be {{"{field}": "..."}}'
        )
    text = record[field]
    if not isinstance(text, str):
        raise DataError(f'{where}: "{field}" must be a string, got a JSON {json_type(text)}')
    return unicode_text(text, where, f'"{field}"'), parse_weight(record, where)
