"""The checkpoint store: how any checkpoint format is published, found, verified,
pruned and quarantined (S3, S6, S8). Formats (``state.safetensors_format`` for one
process, ``parallel.dcp_format`` for many ranks) write files; only this module
publishes, and ``LATEST`` always names a complete checkpoint. Clean-up removes only
never-published temporaries; a published checkpoint is quarantined, never deleted.
Design and derivations: docs/design/state.md#statestorepy (S3, S6, S8).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from exactstep.errors import CheckpointError, StorageError
from exactstep.state.durable import fsync_path, replace_durably, write_durably
from exactstep.state.manifest import digest_of

LATEST = "LATEST"
CHECKPOINT_MANIFEST = "manifest.json"
QUARANTINE = "quarantine"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST_TMP_PREFIX = f".{LATEST}.tmp-"
HASH_WORKERS = 2


# ---------------------------------------------------------------- names


def check_name(name: str) -> None:
    """Refuse a checkpoint name that could escape ``root`` or collide with the store's own."""
    if (
        not name
        or name.startswith(".")
        or name in (LATEST, QUARANTINE)
        or "/" in name
        or "\\" in name
        or name != name.strip()
    ):
        raise CheckpointError(
            f"checkpoint name {name!r} is not allowed; use a plain name such as 'step_000100'"
        )


def temporary_directory(root: Path, name: str, tag: str) -> Path:
    """Where a publication of ``name`` writes its files (every rank computes the same)."""
    return Path(root) / f"{TMP_PREFIX}{name}-{tag}"


# ---------------------------------------------------------------- publish


class Publication:
    """One checkpoint being written into its temporary directory, then committed.

    Use as a context manager: files written with ``write`` (or written by the caller
    under ``directory`` and then ``add``-ed) are sealed as they arrive; ``commit``
    publishes them. Leaving the block with an exception removes the temporary
    directory (it was never published) and turns a failed write (disk full, quota,
    read-only) into one ``StorageError`` that says the previous checkpoint is intact.
    """

    def __init__(self, root: Path, name: str, *, tag: str | None = None) -> None:
        check_name(name)
        self.root = Path(root)
        self.name = name
        self.directory = temporary_directory(self.root, name, tag or str(os.getpid()))
        self._pool: ThreadPoolExecutor | None = None
        self._sealed: dict[str, Future] = {}

    def __enter__(self) -> Publication:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.directory.exists():
                shutil.rmtree(self.directory)
            self.directory.mkdir()
        except OSError as exc:
            raise self._storage_error(exc) from None
        self._pool = ThreadPoolExecutor(max_workers=HASH_WORKERS)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._close_pool()
        if exc is None:
            return
        shutil.rmtree(self.directory, ignore_errors=True)
        cause = _io_cause(exc)
        if cause is not None and not isinstance(exc, StorageError):
            raise self._storage_error(cause) from None

    def write(self, relative: str, data: bytes) -> None:
        """Write a file of the checkpoint and seal it."""
        write_durably(self.directory / relative, data)
        self.add(relative)

    def add(self, relative: str) -> None:
        """Seal a file the caller wrote under ``directory`` (fsync + sha256, in the background)."""
        assert self._pool is not None, "use Publication as a context manager"
        self._sealed[relative] = self._pool.submit(_seal, self.directory / relative)

    def commit(self, *, format: str, parts: Mapping[str, str], keep: int,
               fields: Mapping[str, Any] | None = None) -> Path:
        """Publish: the manifest last, rename into place, ``LATEST``, prune (S3, S8).

        ``parts`` maps a part label to the file (or sub-directory) holding it, for
        loaders and for ``verify``'s report; ``fields`` are extra format-specific
        manifest entries. Files under the directory that were not sealed yet (e.g.
        written by ``torch.distributed.checkpoint``) are sealed here. When ``root``
        already holds a directory of this name, it is kept if it verifies as the
        same checkpoint, and quarantined otherwise. Returns ``root/<name>``.
        """
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 (got {keep}); set checkpoint.keep >= 1")
        files = self._seal_all()
        manifest = {
            **dict(fields or {}),
            "format": format,
            "name": self.name,
            "sequence": next_sequence(self.root),
            "parts": dict(parts),
            "files": files,
        }
        final = self.root / self.name
        try:
            if final.exists() and _same_checkpoint(final, manifest):
                shutil.rmtree(self.directory, ignore_errors=True)
            else:
                if final.exists():
                    quarantine(self.root, final)
                manifest["digest"] = digest_of(manifest)
                write_durably(self.directory / CHECKPOINT_MANIFEST, _manifest_bytes(manifest))
                for sub in {Path(f).parent for f in files} - {Path(".")}:
                    fsync_path(self.directory / sub)
                fsync_path(self.directory)
                os.rename(self.directory, final)
                fsync_path(self.root)
            point_latest(self.root, self.name)
        except OSError as exc:
            raise self._storage_error(exc) from None
        prune(self.root, keep)
        return final

    def _seal_all(self) -> dict[str, dict[str, Any]]:
        for path in sorted(self.directory.rglob("*")):
            relative = path.relative_to(self.directory).as_posix()
            if path.is_file() and relative not in self._sealed:
                self.add(relative)
        return {relative: self._sealed[relative].result() for relative in sorted(self._sealed)}

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _storage_error(self, cause: OSError) -> StorageError:
        try:
            previous = read_latest_name(self.root)
        except CheckpointError:
            previous = None
        kept = (f"the previous checkpoint {previous} is intact" if previous
                else "no earlier checkpoint was published")
        return StorageError(f"writing checkpoint {self.name} in {self.root} failed "
                            f"({cause.strerror or cause}); {kept}")


def _io_cause(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a failed write (torch and safetensors wrap it)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if type(exc).__name__ == "SafetensorError" and "I/O error" in text:
        return OSError(text.split("I/O error: ")[-1])
    return None


def _seal(path: Path) -> dict[str, Any]:
    """fsync a written file, then return its size and sha256 (S3)."""
    fsync_path(path)
    return file_record(path)


def file_record(path: Path) -> dict[str, Any]:
    return {"sha256": sha256_mapped(path), "bytes": path.stat().st_size}


def sha256_mapped(path: Path) -> str:
    """sha256 of a file, read through a memory map (no copy into Python bytes)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return hashlib.sha256(b"").hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True, allow_nan=False, ensure_ascii=False)
            + "\n").encode("utf-8")


def _same_checkpoint(existing: Path, manifest: Mapping[str, Any]) -> bool:
    """True when ``existing`` verifies and holds exactly the files about to be published."""
    report = verify_checkpoint(existing)
    if not report.ok:
        return False
    recorded = read_checkpoint_manifest(existing)
    return (recorded["format"] == manifest["format"] and recorded["files"] == manifest["files"]
            and recorded["parts"] == manifest["parts"])


def point_latest(root: Path, name: str) -> None:
    """Replace ``root/LATEST`` durably with ``name``."""
    replace_durably(Path(root) / LATEST, (name + "\n").encode("utf-8"))


def quarantine(root: Path, path: Path) -> Path:
    """Move a published checkpoint aside to ``root/quarantine/`` (S8). Returns its new path."""
    root = Path(root)
    target_dir = root / QUARANTINE
    target_dir.mkdir(exist_ok=True)
    target = target_dir / path.name
    k = 0
    while target.exists():
        k += 1
        target = target_dir / f"{path.name}.{k}"
    os.rename(path, target)
    fsync_path(target_dir)
    fsync_path(root)
    return target


# ---------------------------------------------------------------- read


def read_latest_name(root: Path) -> str | None:
    """The name ``root/LATEST`` holds, ``None`` when absent; ``CheckpointError`` if garbage."""
    file = Path(root) / LATEST
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}); resume with --from PATH") from None
    name = text.strip()
    try:
        check_name(name)
    except CheckpointError:
        raise CheckpointError(
            f"{file} holds {text[:40]!r}, not a checkpoint name; resume with --from PATH"
        ) from None
    return name


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/LATEST`` names, or ``None`` if nothing was published yet.

    Follows only the pointer (S3). Raises ``CheckpointError`` if ``LATEST`` is
    unreadable or names a directory that does not exist.
    """
    root = Path(root)
    name = read_latest_name(root)
    if name is None:
        return None
    path = root / name
    if not path.is_dir():
        raise CheckpointError(
            f"{root / LATEST} names {name!r} but {path} does not exist; "
            "resume from an earlier checkpoint with --from"
        )
    return path


def read_checkpoint_manifest(path: Path) -> dict[str, Any]:
    """A checkpoint's ``manifest.json``, checked against its own digest (S6).

    Raises ``CheckpointError`` naming the file when it is missing, unreadable, not a
    checkpoint manifest, edited (digest mismatch), or names files outside ``path``.
    """
    path = Path(path)
    file = path / CHECKPOINT_MANIFEST
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint file {file} is missing; {path} was never completely published "
            "(or was damaged), resume from an earlier checkpoint with --from"
        )
    try:
        manifest = json.loads(file.read_bytes().decode("utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        recorded = manifest.pop("digest", None)
        if recorded is None:
            raise ValueError("it has no digest (written by an older exactstep)")
        if digest_of(manifest) != recorded:
            raise ValueError("its content does not match its digest")
        if not (isinstance(manifest["format"], str) and isinstance(manifest["name"], str)
                and type(manifest["sequence"]) is int and isinstance(manifest["parts"], dict)):
            raise ValueError("format, name, sequence or parts is malformed")
        for filename, record in manifest["files"].items():
            _check_filename(filename)
            if not isinstance(record["sha256"], str) or type(record["bytes"]) is not int:
                raise ValueError(f"bad record for {filename}")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint file {file} is corrupted ({exc})") from None
    return manifest


def checkpoint_format(path: Path) -> str | None:
    """The ``format`` a checkpoint's manifest declares, or ``None`` if it is unreadable."""
    try:
        return read_checkpoint_manifest(path)["format"]
    except CheckpointError:
        return None


def _check_filename(filename: str) -> None:
    parts = filename.split("/")
    if "\\" in filename or any(not p or p in (".", "..") for p in parts) or parts[0].startswith("."):
        raise ValueError(f"file name {filename!r} escapes the checkpoint directory")


def check_files(path: Path, manifest: Mapping[str, Any], names: list[str] | None = None) -> None:
    """Recompute size and sha256 of ``names`` (all listed files by default); raise
    ``CheckpointError`` naming the first missing or corrupted file (S6)."""
    path = Path(path)
    files = manifest["files"]
    names = list(files) if names is None else names
    for filename in names:
        if filename not in files or not (path / filename).is_file():
            raise CheckpointError(
                f"checkpoint file {path / filename} is missing; the checkpoint is incomplete, "
                "resume from an earlier one with --from"
            )
    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        found = dict(zip(names, pool.map(file_record, [path / f for f in names]), strict=True))
    for filename in names:
        problem = _problem(found[filename], files[filename])
        if problem:
            raise CheckpointError(
                f"checkpoint file {path / filename} is corrupted ({problem}); "
                "resume from an earlier checkpoint with --from"
            )


def _problem(found: Mapping[str, Any], record: Mapping[str, Any]) -> str | None:
    if found["bytes"] != record["bytes"]:
        return f"{found['bytes']} bytes, expected {record['bytes']}"
    if found["sha256"] != record["sha256"]:
        return f"sha256 {found['sha256'][:12]}…, expected {record['sha256'][:12]}…"
    return None


# ---------------------------------------------------------------- verify


@dataclass(frozen=True)
class PartReport:
    """One file of a checkpoint: which part it holds and what verification found."""

    part: str
    file: str
    expected_sha256: str
    actual_sha256: str | None
    status: str  # "ok" | "missing" | "corrupted"
    detail: str = ""


@dataclass(frozen=True)
class VerifyReport:
    """Result of ``verify_checkpoint``: one ``PartReport`` per file, plus problems
    that concern the checkpoint as a whole (missing manifest, unlisted files)."""

    path: Path
    parts: list[PartReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(p.status == "ok" for p in self.parts)

    @property
    def bad_files(self) -> list[str]:
        return [p.file for p in self.parts if p.status != "ok"]

    def summary(self) -> str:
        """One clause naming what is wrong (for error messages)."""
        bad = [f"{p.file} is {p.status}" for p in self.parts if p.status != "ok"]
        return "; ".join(bad + self.problems) or "ok"

    def format(self) -> str:
        """Human-readable lines for ``exactstep checkpoint verify`` (S6)."""
        lines = [f"checkpoint {self.path}"]
        for p in self.parts:
            digest = p.actual_sha256 or "-"
            extra = f"  ({p.detail})" if p.detail else ""
            lines.append(f"  {p.status:<9} {p.part:<10} {p.file:<20} sha256 {digest}{extra}")
        for problem in self.problems:
            lines.append(f"  problem   {problem}")
        lines.append("  verdict   " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "ok": self.ok,
            "parts": [p.__dict__ for p in self.parts],
            "problems": list(self.problems),
        }


def verify_checkpoint(path: Path) -> VerifyReport:
    """Recompute every file's sha256 and size and compare with the manifest (S6).

    Never raises for a damaged checkpoint: a missing, unreadable or edited checkpoint
    manifest is reported as a problem, and each listed file as ok/missing/corrupted.
    Files present in the directory but not listed are reported as problems too.
    """
    path = Path(path)
    try:
        manifest = read_checkpoint_manifest(path)
    except CheckpointError as exc:
        return VerifyReport(path=path, problems=[str(exc)])
    reports = [
        _verify_file(path, filename, part_of(manifest, filename), record)
        for filename, record in manifest["files"].items()
    ]
    listed = set(manifest["files"]) | {CHECKPOINT_MANIFEST}
    present = (p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    extra = sorted(name for name in present if name not in listed)
    problems = [f"file {name} is not listed in {CHECKPOINT_MANIFEST}" for name in extra]
    return VerifyReport(path=path, parts=reports, problems=problems)


def part_of(manifest: Mapping[str, Any], filename: str) -> str:
    """The part label whose file (or sub-directory) holds ``filename``."""
    for part, where in manifest["parts"].items():
        if filename == where or filename.startswith(where.rstrip("/") + "/"):
            return part
    return "?"


def _verify_file(directory: Path, filename: str, part: str,
                 record: Mapping[str, Any]) -> PartReport:
    file = directory / filename
    expected = record["sha256"]
    if not file.is_file():
        return PartReport(part, filename, expected, None, "missing", "file does not exist")
    found = file_record(file)
    if found["bytes"] != record["bytes"]:
        detail = f"{found['bytes']} bytes, expected {record['bytes']}"
        return PartReport(part, filename, expected, found["sha256"], "corrupted", detail)
    if found["sha256"] != expected:
        return PartReport(part, filename, expected, found["sha256"], "corrupted", "sha256 differs")
    return PartReport(part, filename, expected, found["sha256"], "ok")


# ---------------------------------------------------------------- listing


def published_checkpoints(root: Path) -> list[Path]:
    """Every checkpoint directory with a readable manifest, in publication order.

    This includes a checkpoint renamed into place whose ``LATEST`` update never
    happened; it does not check file digests (``verify_checkpoint`` does).
    """
    root = Path(root)
    found: list[tuple[int, str]] = []
    if not root.is_dir():
        return []
    for entry in root.iterdir():
        if entry.name.startswith(".") or entry.name == QUARANTINE or not entry.is_dir():
            continue
        try:
            found.append((read_checkpoint_manifest(entry)["sequence"], entry.name))
        except CheckpointError:
            continue
    return [root / name for _, name in sorted(found)]


def next_sequence(root: Path) -> int:
    sequences = [read_checkpoint_manifest(p)["sequence"] for p in published_checkpoints(root)]
    return max(sequences, default=-1) + 1


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints (publication order): published no later than ``LATEST``'s.

    Empty when ``LATEST`` is absent or names no readable checkpoint.
    """
    root = Path(root)
    try:
        latest = read_latest_name(root)
    except CheckpointError:
        return []
    published = published_checkpoints(root)
    names = [p.name for p in published]
    if latest not in names:
        return []
    return published[: names.index(latest) + 1]


def prune(root: Path, keep: int) -> list[Path]:
    """Remove committed checkpoints older than the newest ``keep``; never ``LATEST``'s.

    Each removal renames the directory to a trash name first, so a crash mid-removal
    never leaves a partial directory that looks like a checkpoint. Returns the
    removed paths.
    """
    root = Path(root)
    committed = list_checkpoints(root)
    doomed = committed[: max(0, len(committed) - keep)]
    for path in doomed:
        trash = root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(path, trash)
        fsync_path(root)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def clean_uncommitted(root: Path) -> list[Path]:
    """Remove what an interrupted publication or prune left behind (S3, S8).

    Only temporary names are removed: ``.tmp-*`` and ``.trash-*`` directories and
    stray ``LATEST`` temporaries. Nothing with a published name is touched, even a
    checkpoint newer than ``LATEST`` or one that fails verification. Returns the
    removed paths.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed: list[Path] = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((TMP_PREFIX, TRASH_PREFIX)) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        elif entry.name.startswith(LATEST_TMP_PREFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        fsync_path(root)
    return removed
