"""``exactstep prepare``: tokenize a source once into prepared shards (P1).

The source is read and split exactly as a run would read it (``data.corpus`` for
text, ``rows.sources.split_conversations`` for chat), each document becomes the
example the in-memory path would build, and the examples are written in source order
into shards of about ``shard_tokens`` tokens (a shard closes at the first document
boundary at or past that size). The layout is ``data.prepared``'s.

Invariants:

- Byte-identical output for the same source, settings and tokenizer whatever
  ``workers`` is: documents are encoded in fixed chunks of ``CHUNK_DOCUMENTS``
  (``ProcessPoolExecutor.map`` keeps their order) and written by this process alone;
  shard boundaries depend only on the documents' lengths.
- Publication is atomic, like a checkpoint's (S3): everything is written and fsynced
  in ``.<out>.partial`` beside ``out``, ``prepared.json`` last, then the directory is
  renamed into place and its parent fsynced. An interrupted preparation leaves only
  the ``.partial`` directory, which is never read as prepared data and which the next
  ``prepare`` into the same ``--out`` removes before starting again.

Failure modes (one ``error:`` line each at the CLI): a source with no document
(``DataError`` from the reader), an empty train or validation split, an ``--out``
that already holds something, ``--workers`` below 1.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from exactstep.data.chat import template_for
from exactstep.data.corpus import load_corpus
from exactstep.data.prepared import (
    FORMAT,
    INDEX_COLUMNS,
    MANIFEST,
    VERSION,
    fingerprint_of,
    manifest_bytes,
    shard_names,
    token_dtype,
)
from exactstep.data.tokenizer import build_tokenizer
from exactstep.durable import fsync_path, sha256_file, write_durably
from exactstep.errors import ConfigError, DataError
from exactstep.rows.chat import ChatReport, chat_example
from exactstep.rows.example import encode_documents
from exactstep.rows.prepared import ORDER_RULE
from exactstep.rows.sources import chat_policy_of, representation_of, split_conversations

CHUNK_DOCUMENTS = 256  # documents per encoding task (fixed: output must not depend on workers)
SHARD_TOKENS = 1 << 27  # ~128 M tokens per shard (256 MB as uint16)
BLOCK_DOCUMENTS = 4096  # documents per block of the declared epoch order


def prepare(cfg: Any, source: str, out: Path, *, workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, block_documents: int = BLOCK_DOCUMENTS,
            progress: bool = True) -> dict[str, Any]:
    """Prepare ``source`` with ``cfg``'s tokenizer (and chat settings) into ``out``.

    Returns the published ``prepared.json`` content.
    """
    if workers < 1:
        raise ConfigError(f"--workers expects a positive number of processes; got {workers}")
    if shard_tokens < 1 or block_documents < 1:
        raise ConfigError("--shard-tokens and --block-documents must be at least 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not empty; choose a new --out "
                          "or remove it")
    cfg = replace(cfg, data=replace(cfg.data, source=source))
    tokenizer = build_tokenizer(cfg)
    chat = cfg.data.kind == "chat"
    template = template_for(tokenizer) if chat else None
    splits, extra = read_splits(cfg)
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)  # never published (S8): an interrupted earlier attempt
    partial.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {}
    with encoder(cfg, workers) as encode, Progress(progress, splits, dtype) as bar:
        for split, items in splits.items():
            writer = SplitWriter(partial, split, dtype, chat, shard_tokens, tokenizer.vocab_size)
            report = None
            for encoded in encode(chunks(items)):
                for tokens, owned in encoded.documents:
                    writer.add(tokens, owned)
                bar.update(encoded)
                report = merge_reports(report, encoded.report)
            writers[split] = writer.close()
            if report is not None:
                extra[f"chat_{split}"] = report.to_dict()
    meta = manifest(cfg, tokenizer, template, writers, extra, partial, dtype, block_documents)
    write_durably(partial / MANIFEST, manifest_bytes(meta))  # last: it makes the dir complete
    fsync_path(partial)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(partial, out)
    fsync_path(out.parent)
    return meta


def read_splits(cfg: Any) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """(``{"train": items, "val": items}``, what the manifest records about the source)."""
    if cfg.data.kind == "chat":
        train, val, rule, _ = split_conversations(cfg)
        from exactstep.rows.sources import conversations_digest

        return {"train": train, "val": val}, {"split_rule": rule, "source_fingerprint":
                                              conversations_digest(train + val)}
    corpus = load_corpus(cfg.data)
    if any(d.weight is not None for d in corpus.train + corpus.val):
        print("exactstep: note: document weights are not kept in prepared shards (L3)",
              file=sys.stderr)
    return ({"train": list(corpus.train), "val": list(corpus.val)},
            {"split_rule": corpus.split_rule, "source_fingerprint": corpus.fingerprint,
             "skipped_empty": corpus.skipped_empty, "source_name": corpus.source})


def chunks(items: Sequence[Any]) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), CHUNK_DOCUMENTS):
        yield items[start: start + CHUNK_DOCUMENTS]


class Encoded:
    """One chunk's documents as ``(tokens, owned or None)`` plus its chat report."""

    def __init__(self, items: int, documents: list[tuple[np.ndarray, np.ndarray | None]],
                 report: ChatReport | None) -> None:
        self.items = items
        self.documents = documents
        self.report = report
        self.tokens = sum(len(t) for t, _ in documents)


# The encoding process's tokenizer, built once by ``init_worker`` (the pool's
# initializer, or this process for one worker) and cleared when ``encoder`` exits.
_WORKER: dict[str, Any] = {}


def init_worker(cfg: Any) -> None:
    """Build the tokenizer (and template) once per process."""
    tokenizer = build_tokenizer(cfg)
    _WORKER.update(cfg=cfg, tokenizer=tokenizer,
                   template=template_for(tokenizer) if cfg.data.kind == "chat" else None)


def encode_chunk(items: Sequence[Any]) -> Encoded:
    """The examples a run would build from ``items`` (text documents or conversations)."""
    cfg, tokenizer = _WORKER["cfg"], _WORKER["tokenizer"]
    if cfg.data.kind != "chat":
        docs = [(e.tokens, None) for e in encode_documents(items, tokenizer)]
        return Encoded(len(items), docs, None)
    report = ChatReport()
    docs = []
    for conversation in items:
        example = chat_example(conversation, 0, tokenizer, chat_policy_of(cfg),
                               max_len=cfg.batch.seq_len, template=_WORKER["template"],
                               report=report)
        if example is not None:
            owned = example.owned if example.owned is not None else np.arange(len(example)) > 0
            docs.append((example.tokens, owned))
    return Encoded(len(items), docs, report)


class encoder:  # noqa: N801 (a context manager used like a function)
    """``with encoder(cfg, workers) as encode``: ``encode(chunks)`` yields ``Encoded``
    in chunk order, in this process (1 worker) or in a spawned pool."""

    def __init__(self, cfg: Any, workers: int) -> None:
        self.cfg, self.workers = cfg, workers
        self.pool: ProcessPoolExecutor | None = None

    def __enter__(self):
        if self.workers == 1:
            init_worker(self.cfg)
            return lambda items: map(encode_chunk, items)
        self.pool = ProcessPoolExecutor(self.workers, mp_context=get_context("spawn"),
                                        initializer=init_worker, initargs=(self.cfg,))
        return lambda items: self.pool.map(encode_chunk, items)

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
        _WORKER.clear()


class SplitWriter:
    """Appends documents to the shards of one split (see ``data.prepared``)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, chat: bool,
                 shard_tokens: int, vocab_size: int) -> None:
        self.root, self.split, self.dtype, self.chat = root, split, dtype, chat
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.unigram = np.zeros(vocab_size, dtype=np.int64)
        self.documents = self.tokens = self.targets = 0
        self.min_length, self.max_length = 0, 0
        self._open()

    def _open(self) -> None:
        self.names = shard_names(self.split, len(self.shards), self.chat)
        self.fh = {kind: open(self.root / name, "wb") for kind, name in self.names.items()}
        self.index: list[tuple[int, int, int]] = []
        self.offset = 0
        self.bits = np.zeros(0, dtype=bool)  # ownership bits not yet a whole byte

    def add(self, tokens: np.ndarray, owned: np.ndarray | None) -> None:
        n = len(tokens)
        if n == 0:
            raise DataError(f"document {self.documents} of the {self.split} split has no "
                            "tokens; remove it from the source")
        targets_mask = owned[1:] if owned is not None else np.ones(n - 1, dtype=bool)
        targets = int(np.count_nonzero(targets_mask))
        self.fh["tokens"].write(np.asarray(tokens, dtype=self.dtype).tobytes())
        if owned is not None:
            self.bits = np.concatenate([self.bits, owned.astype(bool)])
            whole = len(self.bits) // 8 * 8
            self.fh["owned"].write(np.packbits(self.bits[:whole]).tobytes())
            self.bits = self.bits[whole:]
        if targets:
            np.add.at(self.unigram, tokens[1:][targets_mask], 1)
        self.index.append((self.offset, n, targets))
        self.offset += n
        self.documents += 1
        self.tokens += n
        self.targets += targets
        self.min_length = n if self.documents == 1 else min(self.min_length, n)
        self.max_length = max(self.max_length, n)
        if self.offset >= self.shard_tokens:
            self._close_shard()
            self._open()

    def _close_shard(self) -> None:
        if self.chat and len(self.bits):
            self.fh["owned"].write(np.packbits(self.bits).tobytes())
        index = np.asarray(self.index, dtype=np.int64).reshape(-1, INDEX_COLUMNS)
        self.fh["index"].write(index.tobytes())
        for fh in self.fh.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        self.shards.append({"files": self.names, "documents": len(self.index),
                            "tokens": self.offset})

    def close(self) -> dict[str, Any]:
        """Close the last shard (an empty last shard is not kept) and write the
        unigram counts; returns the split's record for ``prepared.json``."""
        if self.index or not self.shards:
            self._close_shard()
        else:
            for kind, fh in self.fh.items():
                fh.close()
                (self.root / self.names[kind]).unlink()
        write_durably(self.root / f"{self.split}.unigram", self.unigram.tobytes())
        return {"documents": self.documents, "tokens": self.tokens, "targets": self.targets,
                "min_length": self.min_length, "max_length": self.max_length,
                "shards": self.shards}


def merge_reports(total: ChatReport | None, part: ChatReport | None) -> ChatReport | None:
    if part is None:
        return total
    if total is None:
        return part
    return ChatReport(**{f.name: getattr(total, f.name) + getattr(part, f.name)
                         for f in fields(ChatReport)})


def manifest(cfg: Any, tokenizer: Any, template: Any, splits: dict[str, dict[str, Any]],
             extra: dict[str, Any], root: Path, dtype: np.dtype,
             block_documents: int) -> dict[str, Any]:
    """``prepared.json``: format, source, tokenizer, order, counts, file fingerprints."""
    for split, info in splits.items():
        if not info["documents"]:
            raise DataError(f"the {split} split of {cfg.data.source!r} has no document; "
                            "add documents or change data.val_fraction")
    files = {}
    for name in sorted(p.name for p in root.iterdir()):
        files[name] = {"bytes": (root / name).stat().st_size, "sha256": sha256_file(root / name)}
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "kind": cfg.data.kind,
        "source": cfg.data.source,
        "representation": representation_of(tokenizer, template),
        "dtype": dtype.name,
        "order": {"rule": ORDER_RULE, "block_documents": block_documents,
                  "seed": "the run's seed"},
        "splits": splits,
        "files": files,
        "fingerprint": fingerprint_of(files),
    }
    meta.update(extra)
    if cfg.data.kind == "chat":
        meta["max_len"] = cfg.batch.seq_len
        meta["chat_policy"] = asdict(chat_policy_of(cfg))
    return {k: v for k, v in meta.items() if v is not None}


class Progress:
    """A tqdm bar over documents with tokens, MB/s and ETA (stderr), or nothing."""

    def __init__(self, enabled: bool, splits: dict[str, list[Any]], dtype: np.dtype) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.itemsize = dtype.itemsize
        self.total = sum(len(v) for v in splits.values())
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="doc", desc="prepare", file=sys.stderr)
        return self

    def update(self, chunk: Encoded) -> None:
        self.tokens += chunk.tokens
        if self.bar is not None:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix(tokens=self.tokens,
                                 MBps=f"{self.tokens * self.itemsize / elapsed / 1e6:.1f}",
                                 refresh=False)
            self.bar.update(chunk.items)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
