"""``exactstep prepare``: tokenize a source once into prepared shards (P1).

The source is split and compiled exactly as a run would, streamed, and written into
``data.prepared``'s shards, byte-identical whatever the worker count; the directory
is published atomically, one process at a time per ``--out`` (S3, S8, X4).
Design and derivations: docs/design/prepare-export.md#artifactspreparepy (P1, S3, S8, X4).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from exactstep.data.chat import template_for
from exactstep.data.conversation import iter_chat_jsonl
from exactstep.data.corpus import check_split, load_corpus, split_rule, val_bucket
from exactstep.data.datasets_source import (
    is_dataset_source,
    iter_chat_source,
    iter_text_source,
    shard_files,
)
from exactstep.data.documents import iter_jsonl
from exactstep.data.prepared import (
    FORMAT,
    INDEX_COLUMNS,
    MANIFEST,
    SPLITS,
    VERSION,
    fingerprint_of,
    manifest_bytes,
    shard_names,
    token_dtype,
)
from exactstep.errors import ConfigError, DataError, ExactstepError
from exactstep.families import family_tokenizer, run_data_kind
from exactstep.rows.chat import ChatPolicy, ChatReport, chat_example
from exactstep.rows.config import run_section
from exactstep.rows.example import encode_documents
from exactstep.rows.prepared import ORDER_RULE
from exactstep.rows.sources import (
    ARITH_SOURCE,
    chat_split_rule,
    conversations_digest,
    is_val,
    representation_of,
    split_conversations,
)
from exactstep.state.durable import (
    exclusive_lock,
    fsync_path,
    lock_beside,
    sha256_file,
    write_durably,
)

CHUNK_DOCUMENTS = 256  # documents per encoding task (fixed: output must not depend on workers)
SHARD_TOKENS = 1 << 27  # ~128 M tokens per shard (256 MB as uint16)
BLOCK_DOCUMENTS = 4096  # documents per block of the declared epoch order
WATCH_S = 0.5  # how often a worker checks that its parent is still there
PR_SET_PDEATHSIG = 1  # Linux prctl option: a signal for this process when its parent ends


def prepare(cfg: Any, source: str, out: Path, *, workers: int = 1,
            shard_tokens: int = SHARD_TOKENS, block_documents: int = BLOCK_DOCUMENTS,
            progress: bool = True, items: SourceItems | None = None) -> dict[str, Any]:
    """Prepare ``source`` with ``cfg``'s tokenizer (and chat settings) into ``out``.

    ``items``: the split items to write instead of reading ``source`` (``distill``'s
    teacher-answered conversations); ``source`` then only names them.

    Returns the published ``prepared.json`` content. ``out`` is held for the whole
    call (``.<out>.lock`` beside it); another process holding it is a
    ``DirectoryInUse`` before anything is read or written. Shards are byte-identical
    whatever ``workers`` is (P1). Everything is written in ``.<out>.partial`` and
    renamed into place last (S3); an interrupted run leaves only that, which the next
    ``prepare`` into ``out`` removes. Refused (``ExactstepError``): no document, a
    malformed line, an empty split, a non-empty ``out``, ``workers`` below 1.
    """
    if workers < 1:
        raise ConfigError(f"--workers expects a positive number of processes; got {workers}")
    if shard_tokens < 1 or block_documents < 1:
        raise ConfigError("--shard-tokens and --block-documents must be at least 1")
    out = Path(out)
    with exclusive_lock(lock_beside(out), f"--out {out}"):  # S8, X4
        return prepare_held(cfg, source, out, workers, shard_tokens, block_documents, progress,
                            items)


def prepare_held(cfg: Any, source: str, out: Path, workers: int, shard_tokens: int,
                 block_documents: int, progress: bool,
                 items: SourceItems | None = None) -> dict[str, Any]:
    """``prepare`` with ``out`` held."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not empty; choose a new --out "
                          "or remove it")
    cfg = replace(cfg, data=replace(cfg.data, source=source))
    cfg = replace(cfg, data=replace(cfg.data, kind=run_data_kind(cfg)))  # "auto": the family's
    tokenizer = family_tokenizer(cfg)
    chat = cfg.data.kind == "chat"
    template = template_for(tokenizer) if chat else None
    source_items = read_source(cfg) if items is None else items
    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)  # never published (S8): an interrupted earlier attempt
    partial.mkdir(parents=True)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {split: SplitWriter(partial, split, dtype, chat, shard_tokens, tokenizer.vocab_size)
               for split in SPLITS}
    reports: dict[str, ChatReport | None] = dict.fromkeys(SPLITS)
    try:
        with encoder(cfg, workers) as encode, Progress(progress, source_items.total,
                                                       dtype) as bar:
            for encoded in encode(chunks(source_items)):
                for split, tokens, owned in encoded.documents:
                    writers[split].add(tokens, owned)
                for split, report in encoded.reports.items():
                    reports[split] = merge_reports(reports[split], report)
                bar.update(encoded)
        extra = source_items.info()  # raises for an empty source or split
        records = {split: writer.close() for split, writer in writers.items()}
        extra.update({f"chat_{split}": r.to_dict() for split, r in reports.items()
                      if r is not None})
        meta = manifest(cfg, tokenizer, template, records, extra, partial, dtype,
                        block_documents)
    except ExactstepError:
        shutil.rmtree(partial, ignore_errors=True)  # a refusal leaves nothing behind
        raise
    write_durably(partial / MANIFEST, manifest_bytes(meta))  # last: it makes the dir complete
    fsync_path(partial)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(partial, out)
    fsync_path(out.parent)
    return meta


class SourceItems:
    """``(split, item)`` pairs in source order (an item is a ``Document`` or a
    ``Conversation``); ``info()``, once they have all been read, is what the manifest
    records about the source. ``total``: the number of items when known upfront."""

    def __init__(self, pairs: Iterator[tuple[str, Any]], info: Any, total: int | None) -> None:
        self.pairs, self.info, self.total = pairs, info, total

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.pairs


def read_source(cfg: Any) -> SourceItems:
    """The source as a run reads it, streamed: a text JSONL line by line, Parquet/Arrow
    and shard directories one file at a time (``streamed_text``), chat JSONL and chat
    shard directories likewise (``streamed_chat``). The standard-library corpus and the
    generated ``arith`` conversations are loaded and split by the run's own readers
    (``data.corpus``, ``rows.sources``)."""
    path = Path(cfg.data.source)
    if cfg.data.kind == "text" and cfg.data.source != "stdlib":
        if is_dataset_source(path):
            fmt, _ = shard_files(path)  # refuses a missing path or an unknown format now
            return streamed_text(cfg, iter_text_source(path, cfg.data.text_field),
                                 f"{fmt}:{cfg.data.source}")
        return streamed_text(cfg, iter_jsonl(path, cfg.data.text_field),
                             f"jsonl:{cfg.data.source}")
    if cfg.data.kind == "chat" and cfg.data.source != ARITH_SOURCE:
        field = cfg.data.messages_field
        if is_dataset_source(path):
            fmt, _ = shard_files(path)
            return streamed_chat(cfg, iter_chat_source(path, field), f"{fmt}:{cfg.data.source}")
        return streamed_chat(cfg, iter_chat_jsonl(path, field), f"jsonl:{cfg.data.source}")
    if cfg.data.kind == "chat":
        train, val, rule, _ = split_conversations(cfg)
        info = {"split_rule": rule, "source_fingerprint": conversations_digest(train + val)}
    else:
        corpus = load_corpus(cfg.data)
        train, val = list(corpus.train), list(corpus.val)
        info = {"split_rule": corpus.split_rule, "source_fingerprint": corpus.fingerprint,
                "skipped_empty": corpus.skipped_empty, "source_name": corpus.source}
    pairs = itertools.chain((("train", x) for x in train), (("val", x) for x in val))
    return SourceItems(pairs, lambda: info, len(train) + len(val))


STREAMED_FINGERPRINT = ("sha256 of, per split (train, val): the split name, its document "
                        "count and the sha256 of every document's length-prefixed name and "
                        "UTF-8 text, in file order")
STREAMED_CHAT_FINGERPRINT = ("sha256 of, per split (train, val): the split name, its "
                             "conversation count and the sha256 of every conversation's "
                             "length-prefixed canonical JSON (sorted keys), in file order")


def streamed_text(cfg: Any, documents: Iterator[Any], source_name: str) -> SourceItems:
    """Text documents read one at a time: empty documents skipped and counted, each
    split by its name's hash as ``load_corpus`` splits it; the fingerprint is
    ``STREAMED_FINGERPRINT``."""
    frac = cfg.data.val_fraction
    return streamed(
        cfg, documents, source_name,
        fields_of=lambda doc: (doc.name.encode("utf-8"), doc.text.encode("utf-8"))
        if doc.text else None,
        in_val=lambda doc: val_bucket(doc.name) < frac,
        rule=split_rule(frac), fingerprint_rule=STREAMED_FINGERPRINT,
        empty=f"data.source {cfg.data.source!r} holds no non-empty document; point "
              "data.source at a file with text")


def streamed_chat(cfg: Any, conversations: Iterator[Any], source_name: str) -> SourceItems:
    """Conversations read one at a time, each split by its content's hash as
    ``split_conversations`` splits it (the same train and val, in file order); the
    fingerprint is ``STREAMED_CHAT_FINGERPRINT``."""
    frac = cfg.data.val_fraction
    return streamed(
        cfg, conversations, source_name,
        fields_of=lambda c: (json.dumps(c.to_json(), sort_keys=True,
                                        ensure_ascii=False).encode("utf-8"),),
        in_val=lambda c: is_val(c, frac), rule=chat_split_rule(frac),
        fingerprint_rule=STREAMED_CHAT_FINGERPRINT,
        empty=f"chat data {cfg.data.source!r} holds no conversation; point data.source at "
              "a file with conversations")


def streamed(cfg: Any, items: Iterator[Any], source_name: str, *,
             fields_of: Callable[[Any], tuple[bytes, ...] | None],
             in_val: Callable[[Any], bool], rule: str, fingerprint_rule: str,
             empty: str) -> SourceItems:
    """Items read one at a time (one pass, no list): an item whose ``fields_of`` is
    ``None`` is skipped and counted, at most ``data.max_docs`` kept, each put in its
    split by ``in_val``; the fingerprint hashes each split's kept items' fields,
    length-prefixed, in order (``fingerprint_rule`` says so in the manifest)."""
    data = cfg.data
    hashes = {split: hashlib.sha256() for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    skipped = [0]

    def pairs() -> Iterator[tuple[str, Any]]:
        for item in items:
            fields = fields_of(item)
            if fields is None:
                skipped[0] += 1
                continue
            if data.max_docs and sum(counts.values()) == data.max_docs:
                return
            split = "val" if in_val(item) else "train"
            for field in fields:
                hashes[split].update(len(field).to_bytes(8, "big"))
                hashes[split].update(field)
            counts[split] += 1
            yield split, item

    def info() -> dict[str, Any]:
        if not sum(counts.values()):
            raise DataError(empty)
        check_split(range(counts["train"]), range(counts["val"]), data)
        whole = hashlib.sha256()
        for split in SPLITS:
            whole.update(split.encode() + counts[split].to_bytes(8, "big"))
            whole.update(hashes[split].digest())
        return {"split_rule": rule, "source_fingerprint": whole.hexdigest(),
                "source_fingerprint_rule": fingerprint_rule,
                "skipped_empty": skipped[0], "source_name": source_name}

    return SourceItems(pairs(), info, None)


def chunks(items: Iterable[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive runs of ``CHUNK_DOCUMENTS`` pairs (the last may be shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, CHUNK_DOCUMENTS)):
        yield chunk


class Encoded:
    """One chunk's documents as ``(split, tokens, owned or None)`` in chunk order
    (chat conversations dropped by ``chat.empty`` are absent) and, for chat, each
    split's ``ChatReport``."""

    def __init__(self, items: int, documents: list[tuple[str, np.ndarray, np.ndarray | None]],
                 reports: dict[str, ChatReport]) -> None:
        self.items = items
        self.documents = documents
        self.reports = reports
        self.tokens = sum(len(t) for _, t, _ in documents)


# The encoding process's tokenizer, built once by ``init_worker`` (the pool's
# initializer, or this process for one worker) and cleared when ``encoder`` exits.
_WORKER: dict[str, Any] = {}


def init_worker(cfg: Any, parent: int | None = None) -> None:
    """Build the tokenizer (and template) once per process; a pool's worker (``parent``:
    the PID of the process that started it) first arranges to die with its parent."""
    if parent is not None:
        die_with_parent(parent)
    tokenizer = family_tokenizer(cfg)
    _WORKER.update(cfg=cfg, tokenizer=tokenizer,
                   template=template_for(tokenizer) if cfg.data.kind == "chat" else None)


def die_with_parent(parent: int) -> None:
    """End this worker as soon as ``parent`` ends, even by SIGKILL (which runs none of
    the pool's clean-up, and leaves idle workers waiting forever on a queue whose
    other end they hold themselves).

    On Linux ``PR_SET_PDEATHSIG`` has the kernel send SIGKILL when the thread that
    started the worker ends (``encoder`` starts and uses its pool in one thread, for
    the pool's whole life). Everywhere, a daemon thread checks every ``WATCH_S`` that
    ``parent`` is still this process's parent (a dead parent's children are adopted
    by another process), which also covers a parent that died before the first line
    here ran. With the workers gone, multiprocessing's resource tracker sees the end
    of its pipe and exits too.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the thread below is enough
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="exactstep-parent-watch", daemon=True).start()


def encode_chunk(pairs: Sequence[tuple[str, Any]]) -> Encoded:
    """The examples a run would build from each ``(split, item)`` of the chunk."""
    cfg, tokenizer = _WORKER["cfg"], _WORKER["tokenizer"]
    if cfg.data.kind != "chat":
        examples = encode_documents([item for _, item in pairs], tokenizer)
        return Encoded(len(pairs), [(split, e.tokens, None)
                                    for (split, _), e in zip(pairs, examples, strict=True)], {})
    reports: dict[str, ChatReport] = {}
    docs = []
    for split, conversation in pairs:
        example = chat_example(conversation, 0, tokenizer, run_section(cfg, "chat", ChatPolicy),
                               max_len=cfg.batch.seq_len, template=_WORKER["template"],
                               report=reports.setdefault(split, ChatReport()))
        if example is not None:
            owned = example.owned if example.owned is not None else np.arange(len(example)) > 0
            docs.append((split, example.tokens, owned))
    return Encoded(len(pairs), docs, reports)


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
                                        initializer=init_worker,
                                        initargs=(self.cfg, os.getpid()))
        return self.ordered

    def ordered(self, chunks: Iterable[Any]) -> Iterator[Encoded]:
        """Results in submission order with at most ``2 * workers`` chunks in flight
        (``Executor.map`` would read the whole source before the first result)."""
        assert self.pool is not None
        pending: deque = deque()
        for chunk in chunks:
            pending.append(self.pool.submit(encode_chunk, chunk))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

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
    }
    meta.update(extra)
    if cfg.data.kind == "chat":
        meta["max_len"] = cfg.batch.seq_len
        meta["chat_policy"] = asdict(run_section(cfg, "chat", ChatPolicy))
    meta = {k: v for k, v in meta.items() if v is not None}
    meta["fingerprint"] = fingerprint_of(meta)
    return meta


class Progress:
    """A tqdm bar over documents with tokens, MB/s and ETA (stderr), or nothing."""

    def __init__(self, enabled: bool, total: int | None, dtype: np.dtype) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.itemsize = dtype.itemsize
        self.total = total
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
