"""The prepared-data format: token shards read through memory maps (P1, P2, S6).

A prepared directory holds, per split, shards of tokens, a document index and (chat)
ownership bits, with ``prepared.json`` written last. ``open_prepared`` checks sizes,
digests and the schema before a byte is used, then serves each document from memory
maps as the same tokens the in-memory path builds for that example.
Design and derivations: docs/design/data.md#datapreparedpy (P1, P2, S6, X4).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from exactstep.errors import DataError
from exactstep.state.durable import sha256_file
from exactstep.state.manifest import canonical_json, digest_of

FORMAT = "exactstep-prepared"
VERSION = 1
MANIFEST = "prepared.json"
SPLITS = ("train", "val")
INDEX_COLUMNS = 3  # offset, length, owned targets


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (``vocab_size <= 65536``), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_names(split: str, number: int, chat: bool) -> dict[str, str]:
    """The file names of shard ``number`` of ``split`` (``owned`` only for chat)."""
    stem = f"{split}-{number:05d}"
    names = {"tokens": f"{stem}.tokens", "index": f"{stem}.index"}
    if chat:
        names["owned"] = f"{stem}.owned"
    return names


def is_prepared(source: str | Path) -> bool:
    """Whether ``source`` names a prepared directory: it holds ``prepared.json``, or
    shard files without it (then ``read_meta`` says what is missing)."""
    path = Path(source)
    return path.is_dir() and ((path / MANIFEST).is_file() or any(path.glob("train-*.tokens")))


def fingerprint_of(meta: dict[str, Any]) -> str:
    """The directory's fingerprint: sha256 of the canonical JSON of ``prepared.json``
    without its ``fingerprint`` key (every file record, count and setting)."""
    return digest_of({k: v for k, v in meta.items() if k != "fingerprint"})


@dataclass(frozen=True)
class Shard:
    """One shard's memory maps: ``tokens [n]``, ``index [documents, 3]``, ``owned``
    (packed bits, chat) or ``None``. Nothing is read until a document is asked for.

    ``files`` (set by ``open_shard``: directory, file names, token dtype) says where
    the maps come from; a shard with ``files`` pickles as those names and is mapped
    again where it is unpickled (a loader process, ``rows.loader_process``), so no
    token is copied and nothing is hashed again: the opening process checked them.
    """

    tokens: np.ndarray
    index: np.ndarray
    owned: np.ndarray | None
    files: tuple[Path, dict[str, str], np.dtype] | None = field(default=None, compare=False)

    def __reduce__(self):
        if self.files is None:  # arrays of this process only: pickled whole
            return (Shard, (self.tokens, self.index, self.owned))
        return (open_shard, self.files)


class PreparedSplit:
    """The documents of one split across its shards, addressed by a global id.

    ``lengths`` and ``targets`` are views of the memory-mapped indexes: a document's
    length is read from disk, never from a list built at start-up (P2).
    """

    def __init__(self, shards: list[Shard], info: dict[str, Any]) -> None:
        self.shards = shards
        self.info = info
        counts = [int(s.index.shape[0]) for s in shards]
        self.starts: list[int] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist()
        self.documents = self.starts[-1]
        self.min_length = int(info.get("min_length", 1))
        self.max_length = int(info.get("max_length", 0))

    def locate(self, doc: int) -> tuple[Shard, int]:
        """(shard, row in its index) of global document ``doc``."""
        if not 0 <= doc < self.documents:
            raise IndexError(doc)
        k = bisect.bisect_right(self.starts, doc) - 1
        return self.shards[k], doc - self.starts[k]

    def entry(self, doc: int, column: int) -> int:
        """Column ``column`` (0 offset, 1 length, 2 owned targets) of document ``doc``."""
        shard, row = self.locate(doc)
        return int(shard.index[row, column])

    def tokens(self, doc: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document ``doc``'s tokens (int64 copy) and ownership (bool, or ``None`` for
        text, where every token but the first is a target). A document is the whole
        example the in-memory path builds (text: ``BOS + ids + EOS``), never empty."""
        shard, row = self.locate(doc)
        offset, length = int(shard.index[row, 0]), int(shard.index[row, 1])
        tokens = np.asarray(shard.tokens[offset: offset + length], dtype=np.int64)
        if shard.owned is None:
            return tokens, None
        first, last = offset // 8, (offset + length + 7) // 8
        bits = np.unpackbits(shard.owned[first:last])
        start = offset - 8 * first
        return tokens, bits[start: start + length].astype(bool)


@dataclass(frozen=True)
class Prepared:
    """An opened, verified prepared directory.

    Per split: shards ``<split>-NNNNN.tokens`` / ``.index`` / ``.owned`` (chat) and
    ``<split>.unigram``, described by ``prepared.json`` (layout:
    docs/design/data.md#datapreparedpy).
    """

    path: Path
    meta: dict[str, Any]
    splits: dict[str, PreparedSplit]

    @property
    def fingerprint(self) -> str:
        return str(self.meta["fingerprint"])

    @property
    def tokenizer_hash(self) -> str:
        return str(self.meta["representation"]["tokenizer_hash"])

    def unigram(self, split: str) -> np.ndarray:
        """int64 ``[vocab]`` target counts of ``split`` (written by ``prepare``)."""
        return np.fromfile(self.path / f"{split}.unigram", dtype=np.int64)


def read_meta(path: Path) -> dict[str, Any]:
    """``prepared.json`` of ``path``, or ``DataError`` saying how to make one."""
    file = Path(path) / MANIFEST
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path} is not a prepared directory (no {MANIFEST}); "
                        f"make one with 'exactstep prepare SOURCE --out {path}'") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{file} cannot be read ({exc}); prepare {path} again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT \
            or meta.get("version") != VERSION:
        raise DataError(f"{file} is not an {FORMAT} v{VERSION} manifest; prepare {path} again "
                        "with this version of exactstep")
    return meta


class _Schema:
    """The checks of ``check_schema``: each names the dotted key it refuses (X4)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> NoReturn:
        raise DataError(f"{self.path / MANIFEST} is malformed: key '{key}' {problem}; it was "
                        f"not written by this version of 'exactstep prepare' (or was edited): "
                        f"prepare {self.path} again")

    def get(self, node: dict[str, Any], key: str, where: str, kind: str, *,
            optional: bool = False, low: int = 0) -> Any:
        """``node[key]`` of ``kind`` (``int`` at least ``low``, ``str``, ``hex``,
        ``str?``, ``dict``, ``list``); a missing key is ``None`` when ``optional``."""
        dotted = f"{where}.{key}" if where else key
        if key not in node:
            if optional:
                return None
            self.fail(dotted, "is missing")
        value = node[key]
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                self.fail(dotted, f"must be an integer, not {value!r}")
            if value < low:
                self.fail(dotted, f"must be at least {low}, not {value}")
        elif kind == "hex":
            if not (isinstance(value, str) and len(value) == 64
                    and all(c in "0123456789abcdef" for c in value)):
                self.fail(dotted, f"must be a sha256 (64 hex digits), not {value!r}")
        elif kind == "str?":
            if value is not None and not isinstance(value, str):
                self.fail(dotted, f"must be a string or null, not {value!r}")
        elif not isinstance(value, {"str": str, "dict": dict, "list": list}[kind]):
            self.fail(dotted, f"must be a {'JSON object' if kind == 'dict' else kind}, "
                              f"not {type(value).__name__}")
        return value

    def one_of(self, node: dict[str, Any], key: str, where: str, allowed: tuple) -> Any:
        value = node.get(key) if key in node else self.get(node, key, where, "str")
        if value not in allowed:
            dotted = f"{where}.{key}" if where else key
            self.fail(dotted, f"must be one of {', '.join(map(repr, allowed))}, not {value!r}")
        return value


def check_schema(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a ``prepared.json`` that is not whole (X4, S6), before any key is used.

    Every key the readers use is checked for presence, type and range, and the
    records for consistency: each split's counts are the sums of its shards', a
    shard's files are the kind's (``owned`` exactly for chat) and are recorded in
    ``files``, each recorded file is a plain name in the directory with a size and a
    sha256, and an index or token file's size is what its counts make it. The
    fingerprint covers the file, but a ``prepared.json`` edited and fingerprinted again
    must fail here, naming the key, not deep in a loader. Keys no reader uses (a
    count, a description) are covered by the fingerprint alone.
    """
    s = _Schema(path)
    s.get(meta, "fingerprint", "", "hex")
    kind = s.one_of(meta, "kind", "", ("text", "chat"))
    dtype = s.one_of(meta, "dtype", "", ("uint16", "uint32"))
    for key in ("source", "source_fingerprint", "split_rule"):
        s.get(meta, key, "", "str")
    for key in ("source_fingerprint_rule", "source_name"):
        s.get(meta, key, "", "str", optional=True)
    s.get(meta, "skipped_empty", "", "int", optional=True)
    representation = s.get(meta, "representation", "", "dict")
    s.get(representation, "tokenizer_hash", "representation", "str")
    s.get(representation, "template_hash", "representation", "str?")
    order = s.get(meta, "order", "", "dict")
    s.one_of(order, "rule", "order", ("block-permutation",))
    s.get(order, "block_documents", "order", "int", low=1)
    if kind == "chat":
        s.get(meta, "max_len", "", "int", low=1)
        s.get(meta, "chat_policy", "", "dict")
    files = s.get(meta, "files", "", "dict")
    for name, record in files.items():
        where = f"files.{name}"
        if not name or name in (".", "..", MANIFEST) or "/" in name or "\\" in name:
            s.fail("files", f"names {name!r}, which is not a file of the directory")
        if not isinstance(record, dict):
            s.fail(where, f"must be a JSON object, not {type(record).__name__}")
        s.get(record, "bytes", where, "int")
        s.get(record, "sha256", where, "hex")
    splits = s.get(meta, "splits", "", "dict")
    for split in SPLITS:
        _check_split(s, s.get(splits, split, "splits", "dict"), f"splits.{split}", files,
                     chat=kind == "chat", itemsize=np.dtype(dtype).itemsize)
        unigram = f"{split}.unigram"
        if unigram not in files:
            s.fail("files", f"does not record {unigram}")
        if files[unigram]["bytes"] % 8:
            s.fail(f"files.{unigram}.bytes", "must be a whole number of int64 counts")


def _check_split(s: _Schema, info: dict[str, Any], where: str, files: dict[str, Any], *,
                 chat: bool, itemsize: int) -> None:
    documents = s.get(info, "documents", where, "int")
    tokens = s.get(info, "tokens", where, "int")
    targets = s.get(info, "targets", where, "int")
    low = s.get(info, "min_length", where, "int")
    high = s.get(info, "max_length", where, "int")
    if targets > tokens:
        s.fail(f"{where}.targets", f"({targets}) exceeds {where}.tokens ({tokens})")
    if documents and not 1 <= low <= high:
        s.fail(f"{where}.min_length", f"({low}) must be at least 1 and at most "
                                      f"{where}.max_length ({high})")
    shards = s.get(info, "shards", where, "list")
    counted = [0, 0]
    for k, shard in enumerate(shards):
        at = f"{where}.shards.{k}"
        if not isinstance(shard, dict):
            s.fail(at, f"must be a JSON object, not {type(shard).__name__}")
        n = s.get(shard, "documents", at, "int")
        size = s.get(shard, "tokens", at, "int")
        counted[0] += n
        counted[1] += size
        names = s.get(shard, "files", at, "dict")
        expected = {"tokens": size * itemsize, "index": n * INDEX_COLUMNS * 8}
        if chat:
            expected["owned"] = -(-size // 8)
        for role in sorted(expected.keys() | names.keys()):
            key = f"{at}.files.{role}"
            if role not in expected:
                s.fail(key, f"is not a file of a {'chat' if chat else 'text'} shard")
            name = s.get(names, role, f"{at}.files", "str")
            if name not in files:
                s.fail(key, f"names {name!r}, which 'files' does not record")
            if files[name]["bytes"] != expected[role]:
                s.fail(f"files.{name}.bytes", f"is {files[name]['bytes']}, but the shard's "
                                              f"counts ({at}) make it {expected[role]}")
    if counted[0] != documents:
        s.fail(f"{where}.documents", f"is {documents}, but its shards hold {counted[0]}")
    if counted[1] != tokens:
        s.fail(f"{where}.tokens", f"is {tokens}, but its shards hold {counted[1]}")


def check_file(path: Path, name: str, record: dict[str, Any], *, digest: bool) -> None:
    """Refuse a missing, truncated or altered shard file, naming it (S6)."""
    file = path / name
    if not file.is_file():
        raise DataError(f"prepared shard file {file} is missing; prepare {path} again")
    size = file.stat().st_size
    if size != record["bytes"]:
        raise DataError(f"prepared shard file {file} has {size} bytes, {MANIFEST} says "
                        f"{record['bytes']} (truncated or altered); prepare {path} again")
    if digest and sha256_file(file) != record["sha256"]:
        raise DataError(f"prepared shard file {file} does not match its fingerprint in "
                        f"{MANIFEST} (altered); prepare {path} again")


def open_prepared(path: str | Path, *, verify: bool = True,
                  share: tuple[int, int] = (0, 1)) -> Prepared:
    """Open and check a prepared directory (P1, S6).

    Sizes are always checked; ``verify`` also recomputes the sha256 of the files in
    this process's ``share = (rank, world)``: the files, in name order, at positions
    ``rank, rank + world, ...`` (``(0, 1)``: every file). A data-parallel job splits
    the hashing so, and its ranks agree on the verdict (``rows.prepared``). Raises
    ``DataError`` naming the first missing, truncated or altered file, or a
    ``prepared.json`` whose fingerprint does not cover its own file records.
    """
    path = Path(path)
    meta = read_meta(path)
    check_schema(path, meta)
    files = meta["files"]
    if fingerprint_of(meta) != meta.get("fingerprint"):
        raise DataError(f"{path / MANIFEST} was edited (its fingerprint does not match its "
                        "content); prepare the directory again")
    rank, world = share
    for i, name in enumerate(sorted(files)):
        check_file(path, name, files[name], digest=verify and i % world == rank)
    dtype = np.dtype(meta["dtype"])
    splits = {}
    for split in SPLITS:
        info = meta["splits"][split]
        splits[split] = PreparedSplit([open_shard(path, s["files"], dtype) for s in info["shards"]], info)
    return Prepared(path, meta, splits)


def open_shard(path: Path, names: dict[str, str], dtype: np.dtype) -> Shard:
    """Read-only memory maps of one shard (an empty file maps to an empty array)."""
    def mapped(name: str, kind: np.dtype, shape: tuple[int, ...] | None = None) -> np.ndarray:
        file = path / name
        if file.stat().st_size == 0:
            return np.zeros((0,) if shape is None else (0, INDEX_COLUMNS), dtype=kind)
        # a plain ndarray over the map: numpy.memmap's own indexing costs more per call
        array = np.memmap(file, dtype=kind, mode="r").view(np.ndarray)
        return array if shape is None else array.reshape(-1, INDEX_COLUMNS)

    owned = mapped(names["owned"], np.dtype(np.uint8)) if "owned" in names else None
    return Shard(mapped(names["tokens"], dtype), mapped(names["index"], np.dtype(np.int64), (0,)),
                 owned, (Path(path), dict(names), np.dtype(dtype)))


def manifest_bytes(meta: dict[str, Any]) -> bytes:
    """``prepared.json`` bytes: canonical JSON (sorted keys), one trailing newline."""
    return canonical_json(meta) + b"\n"
