"""Durable file writes and append-only journals (S3, S8): the one place that fsyncs.

Every file exactstep must not lose goes through here: in-place, replacing and
never-clobbering writes, the ``Journal`` whose marks a checkpoint records, the
one-process-at-a-time lock on a run directory or output, and the temporaries a killed
process left (never published, so removable, S8).
Design and derivations: docs/design/state.md#statedurablepy (S3, S8, X4).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exactstep.errors import ConfigError, DirectoryInUse, StorageError

# Bytes hashed per read when a journal's prefix is verified.
_CHUNK = 1 << 20
#: A run directory's lock file (``RUN/.exactstep.lock``, see ``locked_directory``).
LOCK_FILE = ".exactstep.lock"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (so renames and creations inside it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it.

    Not atomic: for files inside a temporary directory that is published as a whole
    later; a file replaced in place takes ``replace_durably``."""
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

    The file is written and fsynced under a temporary name and hard-linked into place,
    so a crash leaves no file or the complete one. Returns ``True`` when this call
    created the file, ``False`` when a file was already there (its content is left as
    it is, for the caller to compare).
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


# --------------------------------------------------------------------------- locks


def check_out(out: Path) -> None:
    """``--out`` of a directory published whole must be absent or an empty directory;
    its parent is created."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty directory; "
                          "choose a new export directory")
    if not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)


def publish_directory(tmp: Path, out: Path) -> None:
    """Publish a finished directory whole: fsync every file and the directory, rename
    it to ``out`` (absent, or the empty directory ``check_out`` allowed), fsync the
    parent."""
    for path in tmp.iterdir():
        fsync_path(path)
    fsync_path(tmp)
    if out.exists():
        out.rmdir()  # empty (checked before anything was written)
    os.rename(tmp, out)
    fsync_path(out.parent)


def lock_beside(path: Path) -> Path:
    """The lock file of an output that is published whole at ``path`` (``.NAME.lock``
    beside it, since ``path`` itself must not exist, or stay empty, until then)."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` for the block, or raise ``DirectoryInUse``
    naming the holder's PID (``what`` names the thing locked, e.g. ``--out runs/x``).

    The lock is ``flock`` on the file, so the kernel drops it when the holder ends,
    even by SIGKILL; the file holds the holder's PID and is removed on release. The
    descriptor is not inherited by child processes (PEP 446), so a worker that
    outlives its parent holds no lock. On a file system without ``flock`` the block
    runs unlocked after one warning line. Directories made for the lock file are
    removed again on release if they are empty then (a refused ``--out a/b/c`` leaves
    no ``a/b``).
    """
    lock_path = Path(lock_path)
    made = _first_missing(lock_path.parent)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create {lock_path.parent} ({exc.strerror}); "
                          "choose a directory you can write to") from None
    fd = acquire_lock(lock_path, what)
    try:
        yield
    finally:
        release_lock(fd, lock_path)
        if made is not None:
            _remove_empty(lock_path.parent, made)


def acquire_lock(lock_path: Path, what: str) -> int | None:
    """``exclusive_lock``'s first half: the locked descriptor (``None``: no locks here)."""
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        _unlocked(what, "this system has no flock")
        return None
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create the lock file {lock_path} of {what} "
                               f"({exc.strerror}); choose a directory you can write to"
                               ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            raise DirectoryInUse(f"{what} is in use by {holder} (it holds {lock_path}); "
                                 "wait for it to end, or stop it, then run this command "
                                 "again") from None
        except OSError as exc:  # ENOLCK, EOPNOTSUPP: a file system without locks
            os.close(fd)
            _unlocked(what, exc.strerror or str(exc))
            return None
        if _names(fd, lock_path):
            break
        os.close(fd)  # its last holder removed that file meanwhile: lock the one there now
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass  # the lock is held; the PID only helps the message of a second process
    return fd


def release_lock(fd: int | None, lock_path: Path) -> None:
    """Remove ``lock_path`` (if it is still the file locked) and drop the lock."""
    if fd is None:
        return
    try:
        if _names(fd, Path(lock_path)):
            os.unlink(lock_path)
    except OSError:
        pass  # a lock file left behind holds no lock
    finally:
        os.close(fd)


def _names(fd: int, path: Path) -> bool:
    """Whether ``path`` is (still) the file open as ``fd``."""
    try:
        there = os.stat(path)
    except OSError:
        return False
    here = os.fstat(fd)
    return (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino)


HOLDER_WAIT_S = 0.5  # how long a refused process waits for the holder to write its pid


def _lock_holder(fd: int) -> str:
    """The holder of the lock on ``fd``, by pid: a holder writes its pid just after it
    takes the lock, so a process refused in between reads again for up to
    ``HOLDER_WAIT_S`` before saying only "another process"."""
    deadline = time.monotonic() + HOLDER_WAIT_S
    while True:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        if text.isdigit():
            return f"process {text}"
        if time.monotonic() >= deadline:
            return "another process"
        time.sleep(0.01)


def _unlocked(what: str, why: str) -> None:
    print(f"exactstep: warning: {what} cannot be locked ({why}); nothing stops another "
          "process from using it at the same time", file=sys.stderr)


@contextlib.contextmanager
def locked_directory(path: Path, what: str, *, committed: str | None = None
                     ) -> Iterator[Path]:
    """Create ``path`` if needed (``ensure_writable_dir``) and hold its lock
    (``path/LOCK_FILE``, ``exclusive_lock``) for the block (S8, X4).

    With ``committed`` (a file whose presence means the directory holds something
    committed, e.g. a run's ``manifest.json``): when the block raises before that file
    exists, what this call created is removed again: the entries that appeared in
    ``path`` during the block and, when ``path`` did not exist before, ``path`` itself
    with the parents this call made. A refused start leaves nothing new behind; a
    directory holding a committed file, or anything present before, is never touched.
    """
    path = Path(path)
    made = _first_missing(path)
    ensure_writable_dir(path, what)
    lock = path / LOCK_FILE
    fd = acquire_lock(lock, f"{what} {path}")
    try:
        before = set(os.listdir(path)) | {LOCK_FILE}
        try:
            yield path
        except BaseException:
            if committed is not None and not (path / committed).exists():
                _remove_created(path, before, made)
            raise
    finally:
        release_lock(fd, lock)


def _first_missing(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (or ``None``)."""
    missing = None
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            break
        missing = candidate
    return missing


def _remove_created(path: Path, before: set[str], made: Path | None) -> None:
    """``locked_directory``'s clean-up of a refused start (never raises)."""
    try:
        for name in set(os.listdir(path)) - before:
            entry = path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        if made is None:
            return
        (path / LOCK_FILE).unlink(missing_ok=True)  # still locked: a waiter looks again
        _remove_empty(path, made)
    except OSError:
        pass  # what is left is this process's own and empty of anything committed


def _remove_empty(path: Path, made: Path) -> None:
    """rmdir ``path`` and its parents up to ``made`` while they are empty."""
    for directory in (path, *path.parents):
        try:
            directory.rmdir()
        except OSError:
            return
        if directory == made:
            return


# Temporary sibling names: ``.NAME.tmp-PID`` (``_temporary_sibling``, an export's directory).
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp-(?P<pid>[0-9]+)")


def stale_temporaries(path: Path) -> list[Path]:
    """The temporary siblings of ``path`` (``.NAME.tmp-PID``) whose process no longer
    runs: a process removes its own on every exit it sees, so these were left by a
    killed one and were never published (S8). A name whose PID runs is kept."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = []
    for entry in sorted(path.parent.iterdir()):
        match = _TEMPORARY.fullmatch(entry.name)
        if match and match["name"] == path.name and not pid_running(int(match["pid"])):
            stale.append(entry)
    return stale


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc here: it exists
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


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
