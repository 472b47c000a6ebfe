"""Text corpora: the built-in standard-library corpus and user JSONL files (S1).

Invariants:

- Loading is deterministic: the same source gives the same documents in the same
  order, the same split and the same fingerprint, on every run and machine with the
  same files.
- The split is decided per document from ``sha256(name)`` alone, so adding or removing
  one document never moves another between train and validation.
- ``fingerprint`` is a sha256 over every document's name and UTF-8 bytes (train then
  validation, each in order, each field length-prefixed), recorded in the manifest.
- Empty documents are skipped and counted (``skipped_empty``); they carry no tokens.

Failure modes (all ``DataError`` naming the file, line or setting to change): a missing
file, a line that is not JSON, a line without a string ``"text"``, a corpus with no
non-empty document, and an empty train or validation split.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from exactstep.data.config import DataConfig
from exactstep.errors import ConfigError, DataError

STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class Document:
    """One document: a stable ``name`` (used for the split) and its ``text``."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Documents split into train and validation, with what the manifest records."""

    train: tuple[Document, ...]
    val: tuple[Document, ...]
    fingerprint: str
    source: str
    split_rule: str
    skipped_empty: int = 0

    def manifest_section(self) -> dict:
        """The data section of the manifest (S1): source, fingerprint, split."""
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "split_rule": self.split_rule,
            "train_documents": len(self.train),
            "val_documents": len(self.val),
            "skipped_empty": self.skipped_empty,
        }


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read the text corpus ``cfg.source`` and split it by name hash.

    ``"stdlib"`` reads the standard library's own ``.py`` files (documents named by
    path relative to the stdlib root; test directories and site-packages skipped);
    anything else is a path to a JSONL file of ``{"text": ...}`` lines.
    Raises ``DataError`` (see module docstring) or ``ConfigError`` for a chat source.
    """
    if cfg.kind != "text":
        raise ConfigError(
            f"data.kind = {cfg.kind!r} is not a text corpus; load_corpus reads data.kind = 'text'"
        )
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        named = read_stdlib(root)
        version = ".".join(map(str, sys.version_info[:3]))
        source = f"stdlib:python{version}"
    else:
        named = read_jsonl(Path(cfg.source))
        source = f"jsonl:{cfg.source}"
    documents, skipped = keep_non_empty(named, cfg.max_docs)
    if not documents:
        raise DataError(
            f"data.source {cfg.source!r} holds no non-empty document; "
            "point data.source at a file with text"
        )
    train, val = split_by_name(documents, cfg.val_fraction)
    check_split(train, val, cfg)
    return Corpus(
        train=train,
        val=val,
        fingerprint=corpus_fingerprint(train, val),
        source=source,
        split_rule=split_rule(cfg.val_fraction),
        skipped_empty=skipped,
    )


def read_stdlib(root: Path) -> list[Document]:
    """Every ``.py`` file under ``root`` outside test dirs and site-packages, sorted."""
    if not root.is_dir():
        raise DataError(
            f"the standard library directory {root} is missing; "
            "set data.source to a .jsonl file instead of 'stdlib'"
        )
    paths = sorted(stdlib_sources(root), key=lambda p: p.relative_to(root).as_posix())
    return [
        Document(name=path.relative_to(root).as_posix(), text=read_text(path)) for path in paths
    ]


def stdlib_sources(root: Path) -> Iterator[Path]:
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in STDLIB_SKIPPED_DIRS)
        for file in files:
            if file.endswith(".py"):
                yield Path(directory) / file


def read_text(path: Path) -> str:
    """File text as UTF-8; undecodable bytes become U+FFFD (deterministic)."""
    return path.read_bytes().decode("utf-8", errors="replace")


def read_jsonl(path: Path) -> list[Document]:
    """Documents from ``{"text": str}`` lines, named ``<file>:<line>``; blank lines skipped."""
    if not path.is_file():
        raise DataError(
            f"data file {path} does not exist; set data.source to 'stdlib' or an existing .jsonl file"
        )
    documents = []
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            documents.append(
                Document(name=f"{path.name}:{line_no}", text=text_of(line, path, line_no))
            )
    return documents


def text_of(line: str, path: Path, line_no: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path} line {line_no} is not valid JSON ({exc.msg}); fix or remove it"
        ) from None
    if not isinstance(record, dict) or "text" not in record:
        raise DataError(
            f'{path} line {line_no} has no "text" field; each line must be {{"text": "..."}}'
        )
    if not isinstance(record["text"], str):
        raise DataError(
            f'{path} line {line_no}: "text" must be a string, got {type(record["text"]).__name__}'
        )
    return record["text"]


def keep_non_empty(documents: list[Document], max_docs: int) -> tuple[list[Document], int]:
    """Non-empty documents, at most ``max_docs`` of them (0 = all), and how many were empty."""
    kept = [d for d in documents if d.text]
    skipped = len(documents) - len(kept)
    if max_docs:
        kept = kept[:max_docs]
    return kept, skipped


def val_bucket(name: str) -> float:
    """A number in [0, 1) fixed by the document's name: first 8 bytes of sha256(name)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_rule(val_fraction: float) -> str:
    return f"val iff int(sha256(name)[:8 bytes], big-endian) / 2**64 < {val_fraction!r}"


def split_by_name(
    documents: list[Document], val_fraction: float
) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    train, val = [], []
    for doc in documents:
        (val if val_bucket(doc.name) < val_fraction else train).append(doc)
    return tuple(train), tuple(val)


def check_split(train: tuple[Document, ...], val: tuple[Document, ...], cfg: DataConfig) -> None:
    total = len(train) + len(val)
    if not val:
        raise DataError(
            f"the validation split of {cfg.source!r} is empty ({total} documents, "
            f"data.val_fraction = {cfg.val_fraction}); raise data.val_fraction or add documents"
        )
    if not train:
        raise DataError(
            f"the training split of {cfg.source!r} is empty ({total} documents, "
            f"data.val_fraction = {cfg.val_fraction}); lower data.val_fraction or add documents"
        )


def corpus_fingerprint(train: tuple[Document, ...], val: tuple[Document, ...]) -> str:
    """sha256 over (split tag, name, bytes) of every document, length-prefixed."""
    h = hashlib.sha256()
    for tag, docs in ((b"train", train), (b"val", val)):
        h.update(tag)
        h.update(len(docs).to_bytes(8, "big"))
        for doc in docs:
            for field in (doc.name.encode("utf-8"), doc.text.encode("utf-8")):
                h.update(len(field).to_bytes(8, "big"))
                h.update(field)
    return h.hexdigest()
