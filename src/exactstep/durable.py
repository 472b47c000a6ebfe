"""Durable file writes and append-only journals (S3, S8): the one place that fsyncs.

Every file exactstep must not lose goes through here:

* ``write_durably(path, data)``: write + flush + fsync a file in place (used inside a
  temporary directory that is published as a whole later).
* ``replace_durably(path, data)``: write a temporary sibling, fsync it, ``os.replace``
  it over ``path``, fsync the directory. A crash leaves the old file or the new one.
* ``create_durably(path, data)``: like ``replace_durably`` but never clobbers: the
  file is hard-linked into place and ``False`` is returned if ``path`` exists.
* ``Journal``: an append-only JSON-lines file (``ledger.jsonl``, ``metrics.jsonl``)
  with a running sha256, so a checkpoint can record *which bytes* of the journal it
  covers (``mark()``) and a resume can prove the journal still holds them
  (``check_mark``) before truncating the tail written after that checkpoint.
* ``ensure_writable_dir``: refuse a run directory that cannot be written, before
  anything is built.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exactstep.errors import ConfigError

# Bytes hashed per read when a journal's prefix is verified.
_CHUNK = 1 << 20


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so renames and creations inside it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _temporary_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def replace_durably(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = _temporary_sibling(path)
    try:
        write_durably(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)


def create_durably(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` durably unless it exists; never clobbers.

    Returns ``True`` when this call created the file, ``False`` when a file was
    already there (its content is left as it is, for the caller to compare).
    """
    path = Path(path)
    tmp = _temporary_sibling(path)
    try:
        write_durably(tmp, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(path.parent)
    return True


def json_bytes(value: Any, *, indent: int | None = 2) -> bytes:
    """Readable JSON (sorted keys, no NaN), one trailing newline."""
    text = json.dumps(value, indent=indent, sort_keys=True, allow_nan=False, ensure_ascii=False,
                      default=str)
    return (text + "\n").encode("utf-8")


def write_json_durably(path: Path, value: Any) -> None:
    """``replace_durably`` of ``json_bytes(value)`` (summary, data report)."""
    replace_durably(path, json_bytes(value))


def sha256_file(path: Path, limit: int | None = None) -> str:
    """sha256 of a file's first ``limit`` bytes (the whole file when ``None``)."""
    h = hashlib.sha256()
    remaining = limit
    with open(path, "rb") as fh:
        while remaining is None or remaining > 0:
            block = fh.read(_CHUNK if remaining is None else min(_CHUNK, remaining))
            if not block:
                break
            h.update(block)
            if remaining is not None:
                remaining -= len(block)
    return h.hexdigest()


def ensure_writable_dir(path: Path, what: str) -> None:
    """Create ``path`` (with parents) or refuse with a ``ConfigError`` naming ``what``.

    Refused: ``path`` or one of its ancestors is a file, the directory cannot be
    created, or it exists but is not writable.
    """
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists() and not candidate.is_dir():
            where = "is" if candidate == path else f"lies below {candidate}, which is"
            raise ConfigError(f"{what} {path} {where} a file, not a directory; choose a "
                              "directory path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what} {path} cannot be created ({exc.strerror}); choose a "
                          "directory you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {path} is not writable; choose a directory you can write to")


class Journal:
    """An append-only JSON-lines file (U4 ledger, X3 metrics).

    Each ``append`` writes one complete line and flushes it, so a crash loses at most
    the line being written (a torn tail). ``mark()`` names the prefix written so far:
    for an ``exact`` journal (the ledger, whose lines are deterministic) the lines,
    bytes and sha256 of those bytes; otherwise (metrics, which hold timings) the
    number of lines. A checkpoint stores the mark; on resume ``check_mark`` proves
    the file still begins with that prefix before ``open_at`` truncates what was
    written after the checkpoint (S8).
    """

    def __init__(self, path: Path, *, lines: int, size: int, digest: Any, exact: bool) -> None:
        self.path = Path(path)
        self.exact = exact
        self._lines = lines
        self._bytes = size
        self._hash = digest

    # ---------------------------------------------------------------- opening

    @classmethod
    def create(cls, path: Path, *, exact: bool = True) -> Journal:
        """A new, empty journal (an existing file is emptied)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, b"")
        return cls(path, lines=0, size=0, digest=hashlib.sha256(), exact=exact)

    @classmethod
    def open_at(cls, path: Path, mark: dict[str, Any]) -> Journal:
        """Continue ``path`` right after ``mark``, dropping every later byte.

        The caller must have checked the mark (``check_mark``); it is checked again
        here and a mismatch raises ``ValueError`` (a bug, not a user error).
        """
        path = Path(path)
        problem = check_mark(path, mark)
        if problem is not None:
            raise ValueError(f"{path}: {problem}")
        if not path.exists():
            path.touch()
        exact = "sha256" in mark
        size = int(mark["bytes"]) if exact else _end_of_line(path, int(mark["lines"]))
        if path.stat().st_size != size:
            with open(path, "r+b") as fh:
                fh.truncate(size)
                fh.flush()
                os.fsync(fh.fileno())
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while block := fh.read(_CHUNK):
                digest.update(block)
        return cls(path, lines=int(mark["lines"]), size=size, digest=digest, exact=exact)

    # ---------------------------------------------------------------- writing

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
                + "\n").encode("utf-8")
        try:
            with open(self.path, "ab") as fh:
                fh.write(line)
                fh.flush()
        except OSError as exc:  # name the file: a flush error carries no filename
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self._hash.update(line)
        self._lines += 1
        self._bytes += len(line)

    def sync(self) -> None:
        """fsync the journal (before a checkpoint records its mark)."""
        fsync_path(self.path)

    # ---------------------------------------------------------------- reading

    @property
    def lines(self) -> int:
        return self._lines

    def mark(self) -> dict[str, Any]:
        """What a checkpoint records (see the class docstring)."""
        if not self.exact:
            return {"lines": self._lines}
        return {"lines": self._lines, "bytes": self._bytes, "sha256": self._hash.hexdigest()}

    def records(self) -> list[dict[str, Any]]:
        return list(read_records(self.path))


def check_mark(path: Path, mark: dict[str, Any]) -> str | None:
    """Why ``path`` does not begin with the prefix ``mark`` recorded, or ``None`` if it does."""
    path = Path(path)
    lines = int(mark["lines"])
    if "sha256" not in mark:
        return _check_line_count(path, lines)
    size = int(mark["bytes"])
    if not path.is_file():
        return None if size == 0 else f"the file is missing but should hold {lines} lines"
    have = path.stat().st_size
    if have >= size and sha256_file(path, size) == mark["sha256"]:
        return None
    first = _first_bad_line(path, min(have, size))
    detail = f" ({first})" if first else ""
    if have < size:
        return (f"it holds {have} bytes but the checkpoint recorded {size} ({lines} lines): "
                f"lines written before that checkpoint were lost{detail}")
    return f"its first {lines} lines differ from what the checkpoint recorded{detail}"


def _check_line_count(path: Path, lines: int) -> str | None:
    if lines == 0:
        return None
    if not path.is_file():
        return f"the file is missing but should hold {lines} lines"
    end = _end_of_line(path, lines)
    first = _first_bad_line(path, end)
    if first:
        return f"{first} among the {lines} lines the checkpoint recorded"
    with open(path, "rb") as fh:
        have = fh.read(end).count(b"\n")
    if have < lines:
        return (f"it holds {have} complete lines but the checkpoint recorded {lines}: "
                "lines written before that checkpoint were lost")
    return None


def _end_of_line(path: Path, lines: int) -> int:
    """Byte offset just after the ``lines``-th newline (or the file size if fewer)."""
    end = 0
    with open(path, "rb") as fh:
        data = fh.read()
    for _ in range(lines):
        newline = data.find(b"\n", end)
        if newline < 0:
            return len(data)
        end = newline + 1
    return end


def _first_bad_line(path: Path, size: int) -> str | None:
    """A hint for a damaged prefix: the first line that is not a JSON object."""
    with open(path, "rb") as fh:
        data = fh.read(size)
    for number, line in enumerate(data.split(b"\n")[:-1], start=1):
        try:
            if not isinstance(json.loads(line), dict):
                raise ValueError
        except ValueError:
            return f"line {number} is not a JSON object"
    return None


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every complete line of a journal that parses as a JSON object (others skipped)."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "rb") as fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
