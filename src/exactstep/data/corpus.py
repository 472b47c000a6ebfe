"""Text corpora: the built-in standard-library corpus and user JSONL files (S1).

``load_corpus`` reads a text source (the stdlib, a JSONL file, or Parquet/Arrow through
``data.datasets_source``) into ``Document`` values, splits them by a hash of each name
and fingerprints them for the manifest, deterministically for the same files.
Design and derivations: docs/design/data.md#datacorpuspy (S1, L3).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from exactstep.data import datasets_source
from exactstep.data.config import DataConfig
from exactstep.data.documents import Document, read_jsonl
from exactstep.errors import ConfigError, DataError

STDLIB_SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


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
    anything else is a path to a JSONL file of ``{"text": ...}`` lines (the key is
    ``cfg.text_field``), or a Parquet/Arrow file or shard directory (``read_source``).
    Deterministic: the same files give the same documents, split and fingerprint; a
    document's split depends on its name alone, and empty documents are skipped and
    counted. Raises ``DataError`` (naming ``<file>:<line>`` or the setting to change)
    for a missing or unreadable file, a line that is not UTF-8, not JSON, not an
    object or without a string text, an unpaired surrogate, a bad ``"weight"``, no
    non-empty document, or an empty split; ``ConfigError`` for a chat source.
    """
    if cfg.kind == "chat":
        raise ConfigError(
            f"data.kind = {cfg.kind!r} is not a text corpus; load_corpus reads data.kind = 'text'"
        )
    if cfg.source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        named = read_stdlib(root)
        version = ".".join(map(str, sys.version_info[:3]))
        source = f"stdlib:python{version}"
    else:
        fmt, named = read_source(Path(cfg.source), cfg.text_field, cfg.columns)
        source = f"{fmt}:{cfg.source}"
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


def read_source(path: Path, text_field: str = "text", columns: tuple[str, ...] = ()
                ) -> tuple[str, list[Document]]:
    """(format, documents) of a data path: a JSONL file here, anything else (Parquet,
    Arrow, a directory of shards) through ``data.datasets_source``."""
    if datasets_source.is_dataset_source(path):
        return datasets_source.read_text_source(path, text_field, columns)
    return "jsonl", read_jsonl(path, text_field, columns=columns)


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


def check_split(train: Sequence[object], val: Sequence[object], cfg: DataConfig) -> None:
    """Refuse an empty training or validation split, naming ``data.val_fraction``."""
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
    """sha256 over (split tag, name, bytes) of every document, length-prefixed.

    When any document carries a weight, every document's weight (``repr`` of the
    float, empty when absent) follows in the same order, so changing a weight changes
    the fingerprint while a corpus without weights keeps its fingerprint.
    """
    h = hashlib.sha256()
    for tag, docs in ((b"train", train), (b"val", val)):
        h.update(tag)
        h.update(len(docs).to_bytes(8, "big"))
        for doc in docs:
            for field in (doc.name.encode("utf-8"), doc.text.encode("utf-8")):
                h.update(len(field).to_bytes(8, "big"))
                h.update(field)
    if any(doc.weight is not None for doc in train + val):
        h.update(b"weights")
        for doc in train + val:
            field = b"" if doc.weight is None else repr(doc.weight).encode("ascii")
            h.update(len(field).to_bytes(8, "big"))
            h.update(field)
    if any(doc.columns for doc in train + val):  # declared columns (data.columns)
        h.update(b"columns")
        for doc in train + val:
            field = json.dumps(doc.columns, sort_keys=True, ensure_ascii=False).encode()
            h.update(len(field).to_bytes(8, "big"))
            h.update(field)
    return h.hexdigest()
