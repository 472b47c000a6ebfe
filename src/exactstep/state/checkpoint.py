"""Checkpoints that are published atomically and verified before use (S2, S3, S6).

Layout of ``root`` (a run's ``checkpoints/`` directory)::

    root/LATEST                 one line: the name of the current checkpoint
    root/<name>/model.safetensors   model weights (tied tensors stored once)
    root/<name>/<part>.json     a part that is plain JSON data (lossless round trip)
    root/<name>/<part>.pt       any other part: torch.save, loadable with weights_only=True
    root/<name>/manifest.json   written last: per-file sha256 and size, part -> file map
    root/.tmp-<name>-<pid>/     a publication in progress (never read; cleaned up)
    root/.trash-<name>-<pid>/   a checkpoint being removed (cleaned up)

Publication (S3): every file is written into the temporary directory and fsynced,
the checkpoint ``manifest.json`` is written last and fsynced, the directory is
fsynced and renamed into place, ``root`` is fsynced, and only then is ``LATEST``
replaced (write temp, fsync, ``os.replace``, fsync ``root``). A crash at any moment
leaves ``LATEST`` naming a complete checkpoint (or absent before the first one).
Readers follow only ``LATEST``. One writer per ``root`` at a time.

Every checkpoint records a publication ``sequence`` number, so pruning keeps the
``keep`` most recently published ones whatever their names are.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from exactstep.errors import CheckpointError
from exactstep.manifest import fsync_dir

LATEST = "LATEST"
CHECKPOINT_MANIFEST = "manifest.json"
MODEL_FILE = "model.safetensors"
MODEL_PART = "model"
FORMAT = "exactstep-checkpoint/1"
# Multi-rank checkpoints (S7, written by ``exactstep.parallel.checkpoint``) share the
# per-file digest records; their files may sit one level down (``dcp/``) and their
# parts are named by file: ``common.pt``, ``rank-NNNNN.pt``, ``dcp/*``.
DIST_FORMAT = "exactstep-dist-checkpoint/1"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
LATEST_TMP_PREFIX = ".LATEST.tmp-"
LAYOUT_KEY = "exactstep.layout"
HASH_WORKERS = 2


# ---------------------------------------------------------------- publish


def publish_checkpoint(
    root: Path,
    name: str,
    model_state: Mapping[str, torch.Tensor],
    parts: Mapping[str, Any],
    *,
    keep: int,
) -> Path:
    """Write a complete checkpoint, publish it atomically as ``LATEST``, prune (S3).

    ``model_state`` goes to ``model.safetensors`` (copied to contiguous CPU tensors;
    tensors sharing storage are stored once and their aliases recorded). Each entry
    of ``parts`` becomes its own file: JSON when the value survives a JSON round trip
    unchanged, otherwise ``torch.save`` (tensors, tuples, int keys ...). Part names
    must be simple file stems other than ``model`` and ``manifest``.

    The previous committed checkpoint is untouched until the new one is published.
    If ``root/<name>`` exists but is not the current ``LATEST`` (left by a publication
    interrupted after its rename), it is replaced. Publishing the name ``LATEST``
    already points to is a no-op when every file would be byte-identical, and raises
    ``CheckpointError`` otherwise. Returns ``root/<name>``.
    """
    root = Path(root)
    _check_name(name)
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1 (got {keep}); set checkpoint.keep >= 1")
    for part in parts:
        _check_part_name(part)
    root.mkdir(parents=True, exist_ok=True)
    current = _read_latest_name(root)
    sequence = _next_sequence(root)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    part_files: dict[str, str] = {}
    # Each file is fsynced and hashed on a worker thread while the next one is
    # serialised (fsync and hashlib release the GIL); all are sealed before the
    # checkpoint manifest is written.
    with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
        pending = {MODEL_FILE: pool.submit(_seal, _write_model(tmp / MODEL_FILE, model_state))}
        part_files[MODEL_PART] = MODEL_FILE
        for part, value in parts.items():
            filename = _write_part(tmp, part, value)
            pending[filename] = pool.submit(_seal, tmp / filename)
            part_files[part] = filename
        files = {filename: future.result() for filename, future in pending.items()}
    manifest = {
        "format": FORMAT,
        "name": name,
        "sequence": sequence,
        "parts": part_files,
        "files": files,
    }
    final = root / name
    if current == name:
        _republish_identical(tmp, final, files, part_files)
        prune(root, keep)
        return final
    _write_file_durably(tmp / CHECKPOINT_MANIFEST, _json_bytes(manifest))
    fsync_dir(tmp)
    _move_into_place(tmp, final, root)
    _point_latest(root, name)
    prune(root, keep)
    return final


def _republish_identical(
    tmp: Path, final: Path, files: Mapping[str, Any], part_files: Mapping[str, str]
) -> None:
    """Publishing LATEST's own name again is a no-op if every file is identical
    (e.g. a resumed run that was already complete); otherwise it is refused,
    because the checkpoint LATEST points to can never be replaced in place."""
    shutil.rmtree(tmp, ignore_errors=True)
    existing = _read_checkpoint_manifest(final)
    if existing["files"] != dict(files) or existing["parts"] != dict(part_files):
        changed = sorted(
            f
            for f in set(files) | set(existing["files"])
            if files.get(f) != existing["files"].get(f)
        )
        raise CheckpointError(
            f"checkpoint {final.name!r} is already the published LATEST in {final.parent} "
            f"with different content ({', '.join(changed)}); publish new state under a new name"
        )


def _write_model(path: Path, model_state: Mapping[str, torch.Tensor]) -> Path:
    unique, aliases = _dedupe_tensors(model_state)
    # One metadata key only: safetensors keeps metadata in a hash map, so several keys
    # would be written in a varying order and identical states would hash differently.
    # Names are listed in the caller's order because safetensors sorts them.
    layout = {"aliases": aliases, "order": list(model_state)}
    metadata = {LAYOUT_KEY: json.dumps(layout, sort_keys=True)}
    safetensors.torch.save_file(unique, str(path), metadata=metadata)
    return path


def _dedupe_tensors(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Contiguous CPU tensors, one per storage view; ``aliases[name] = stored name``.

    Exactly identical views of one storage (tied embedding/head) are stored once.
    Other tensors touching an already-used storage (partial views) are cloned so
    that safetensors, which refuses shared storage, can write them.
    """
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    views: dict[tuple, str] = {}
    storages: set[tuple[str, int]] = set()
    for key, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"model state entry {key!r} is a {type(tensor).__name__}, not a tensor"
            )
        t = tensor.detach()
        if t.numel() == 0:
            unique[key] = t.cpu().contiguous().clone()
            continue
        storage = (str(t.device), t.untyped_storage().data_ptr())
        view = (*storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if view in views:
            aliases[key] = views[view]
            continue
        views[view] = key
        if storage in storages:
            t = t.clone()
        storages.add(storage)
        t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        unique[key] = t
    return unique, aliases


def _write_part(directory: Path, part: str, value: Any) -> str:
    """Write one part (not yet fsynced); returns its file name (``.json`` or ``.pt``)."""
    as_json = _lossless_json(value)
    if as_json is not None:
        filename = f"{part}.json"
        (directory / filename).write_bytes(as_json)
    else:
        filename = f"{part}.pt"
        torch.save(value, directory / filename)
    return filename


def _seal(path: Path) -> dict[str, Any]:
    """fsync a written file, then return its size and sha256 (S3)."""
    fsync_dir(path)  # works for a file too: open read-only, fsync
    return _record(path)


def _lossless_json(value: Any) -> bytes | None:
    """JSON bytes of ``value`` if loading them gives back an equal value of equal types."""
    if not _is_json_plain(value):
        return None
    try:
        data = _json_bytes(value)
    except ValueError:  # NaN / inf
        return None
    return data if _same_plain(json.loads(data), value) else None


def _is_json_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if type(value) is list:
        return all(_is_json_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) is str and _is_json_plain(v) for k, v in value.items())
    return False


def _same_plain(x: Any, y: Any) -> bool:
    if type(x) is not type(y):
        return False
    if isinstance(x, dict):
        return list(x) == list(y) and all(_same_plain(x[k], y[k]) for k in x)
    if isinstance(x, list):
        return len(x) == len(y) and all(_same_plain(u, v) for u, v in zip(x, y, strict=True))
    return x == y


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, allow_nan=False, ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def _write_file_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _record(path: Path) -> dict[str, Any]:
    return {"sha256": _sha256_file(path), "bytes": path.stat().st_size}


def _sha256_file(path: Path) -> str:
    """sha256 of a file, read through a memory map (no copy into Python bytes)."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return hashlib.sha256(b"").hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return hashlib.sha256(view).hexdigest()


def _move_into_place(tmp: Path, final: Path, root: Path) -> None:
    """Rename the finished ``tmp`` to ``final``; an orphan at ``final`` goes to trash."""
    trash = None
    if final.exists():
        trash = root / f"{TRASH_PREFIX}{final.name}-{os.getpid()}"
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(final, trash)
    os.rename(tmp, final)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f"{LATEST_TMP_PREFIX}{os.getpid()}"
    _write_file_durably(tmp, (name + "\n").encode("utf-8"))
    os.replace(tmp, root / LATEST)
    fsync_dir(root)


# ---------------------------------------------------------------- read


def is_distributed_checkpoint(path: Path) -> bool:
    """True when ``path`` holds a multi-rank (DCP) checkpoint (S7)."""
    try:
        return json.loads((Path(path) / CHECKPOINT_MANIFEST).read_bytes())["format"] == DIST_FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/LATEST`` names, or ``None`` if nothing was published yet.

    Follows only the pointer (S3): directories it does not name are never chosen.
    Raises ``CheckpointError`` if ``LATEST`` names a directory that does not exist.
    """
    root = Path(root)
    name = _read_latest_name(root)
    if name is None:
        return None
    path = root / name
    if not path.is_dir():
        raise CheckpointError(
            f"{root / LATEST} names {name!r} but {path} does not exist; "
            "resume from an earlier checkpoint with --from"
        )
    return path


def load_checkpoint(
    path: Path, *, verify: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load ``(model_state, parts)`` from a published checkpoint directory.

    With ``verify`` (the default) every file's size and sha256 are checked against
    the checkpoint manifest before anything is deserialised; a missing or corrupted
    file raises ``CheckpointError`` naming it (S6). Tensors come back on CPU,
    bitwise equal to what was saved; ``.pt`` parts are loaded with
    ``weights_only=True``. Tied tensors come back as one tensor under every name.
    """
    path = Path(path)
    manifest = _read_checkpoint_manifest(path)
    files = manifest["files"]
    for filename in files:
        if not (path / filename).is_file():
            raise CheckpointError(
                f"checkpoint file {path / filename} is missing; the checkpoint is incomplete, "
                "resume from an earlier one with --from"
            )
    if verify:
        with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
            found = dict(zip(files, pool.map(_record, [path / f for f in files]), strict=True))
        for filename, record in files.items():
            problem = _problem(found[filename], record)
            if problem:
                raise CheckpointError(
                    f"checkpoint file {path / filename} is corrupted ({problem}); "
                    "resume from an earlier checkpoint with --from"
                )
    model_state = _load_model(path / MODEL_FILE)
    parts: dict[str, Any] = {}
    for part, filename in manifest["parts"].items():
        if part == MODEL_PART:
            continue
        parts[part] = _load_part(path / filename)
    return model_state, parts


def _problem(found: Mapping[str, Any], record: Mapping[str, Any]) -> str | None:
    if found["bytes"] != record["bytes"]:
        return f"{found['bytes']} bytes, expected {record['bytes']}"
    if found["sha256"] != record["sha256"]:
        return f"sha256 {found['sha256'][:12]}…, expected {record['sha256'][:12]}…"
    return None


def _load_model(file: Path) -> dict[str, torch.Tensor]:
    try:
        with safetensors.safe_open(str(file), framework="pt") as reader:
            metadata = reader.metadata() or {}
        state = safetensors.torch.load_file(str(file))
        layout = json.loads(metadata.get(LAYOUT_KEY, '{"aliases": {}, "order": []}'))
        for alias, stored in layout["aliases"].items():
            state[alias] = state[stored]
        order = layout["order"] or sorted(state)
    except Exception as exc:  # safetensors raises its own error types
        raise CheckpointError(
            f"checkpoint file {file} cannot be read as safetensors ({exc!r})"
        ) from None
    if sorted(order) != sorted(state):
        raise CheckpointError(f"checkpoint file {file} lists tensors inconsistently; it is damaged")
    return {key: state[key] for key in order}


def _load_part(file: Path) -> Any:
    """A ``.json`` part, or a ``.pt`` part loaded weights-only through a private
    memory map (tensors are copy-on-write: writing to them never touches the file)."""
    try:
        if file.suffix == ".json":
            return json.loads(file.read_bytes().decode("utf-8"))
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {file} cannot be deserialised ({exc})") from None


def _read_checkpoint_manifest(path: Path) -> dict[str, Any]:
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
        if manifest["format"] not in (FORMAT, DIST_FORMAT):
            raise ValueError(f"format {manifest['format']!r}, expected {FORMAT!r}")
        distributed = manifest["format"] == DIST_FORMAT
        for filename, record in manifest["files"].items():
            _check_filename(filename, allow_subdir=distributed)
            if not isinstance(record["sha256"], str) or not isinstance(record["bytes"], int):
                raise ValueError(f"bad record for {filename}")
        if distributed:
            manifest["parts"] = {_dist_part(f): f for f in manifest["files"]}
            return manifest
        if manifest["parts"].get(MODEL_PART) != MODEL_FILE:
            raise ValueError("no model part")
        if not set(manifest["parts"].values()) <= set(manifest["files"]):
            raise ValueError("a part names a file without a digest")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint file {file} is corrupted ({exc})") from None
    return manifest


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

    Never raises for a damaged checkpoint: a missing or unreadable checkpoint
    manifest is reported as a problem, and each listed file as ok/missing/corrupted.
    Files present in the directory but not listed are reported as problems too.
    """
    path = Path(path)
    try:
        manifest = _read_checkpoint_manifest(path)
    except CheckpointError as exc:
        return VerifyReport(path=path, problems=[str(exc)])
    part_of = {filename: part for part, filename in manifest["parts"].items()}
    reports = []
    for filename, record in manifest["files"].items():
        reports.append(_verify_file(path, filename, part_of.get(filename, "?"), record))
    listed = set(manifest["files"]) | {CHECKPOINT_MANIFEST}
    present = (str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    extra = sorted(name for name in present if name not in listed)
    problems = [f"file {name} is not listed in {CHECKPOINT_MANIFEST}" for name in extra]
    return VerifyReport(path=path, parts=reports, problems=problems)


def _verify_file(
    directory: Path, filename: str, part: str, record: Mapping[str, Any]
) -> PartReport:
    file = directory / filename
    expected = record["sha256"]
    if not file.is_file():
        return PartReport(part, filename, expected, None, "missing", "file does not exist")
    actual = _sha256_file(file)
    size = file.stat().st_size
    if size != record["bytes"]:
        detail = f"{size} bytes, expected {record['bytes']}"
        return PartReport(part, filename, expected, actual, "corrupted", detail)
    if actual != expected:
        return PartReport(part, filename, expected, actual, "corrupted", "sha256 differs")
    return PartReport(part, filename, expected, actual, "ok")


# ---------------------------------------------------------------- housekeeping


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoints in publication order (oldest first).

    Committed = a visible directory with a readable checkpoint manifest whose
    sequence is not after the one ``LATEST`` names (a newer one was renamed into
    place but never pointed to: it is uncommitted). Empty without ``LATEST``.
    """
    root = Path(root)
    latest = _read_latest_name(root)
    if latest is None:
        return []
    seqs = _sequences(root)
    if latest not in seqs:
        return []
    limit = seqs[latest]
    ordered = sorted((seq, name) for name, seq in seqs.items() if seq <= limit)
    return [root / name for _, name in ordered]


def prune(root: Path, keep: int) -> list[Path]:
    """Remove committed checkpoints older than the newest ``keep``; never the LATEST.

    Each removal renames the directory to a hidden trash name first, so a crash
    mid-removal never leaves a partial directory that looks like a checkpoint.
    Returns the removed paths.
    """
    committed = list_checkpoints(root)
    doomed = committed[: max(0, len(committed) - keep)]
    for path in doomed:
        _remove(path, Path(root))
    return doomed


def clean_uncommitted(root: Path) -> list[Path]:
    """Remove what an interrupted publication or prune left behind (S3).

    That is: temporary and trash directories, stray ``LATEST`` temporaries, and
    checkpoint directories published after the one ``LATEST`` names (or any
    checkpoint directory when there is no ``LATEST``). Directories that do not look
    like exactstep checkpoints are never touched. Returns the removed paths.
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
    latest = _read_latest_name(root)
    seqs = _sequences(root)
    limit = seqs.get(latest, -1) if latest is not None else -1
    for name, seq in sorted(seqs.items()):
        if name != latest and seq > limit:
            _remove(root / name, root)
            removed.append(root / name)
    if removed:
        fsync_dir(root)
    return removed


def _remove(path: Path, root: Path) -> None:
    trash = root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    fsync_dir(root)
    shutil.rmtree(trash, ignore_errors=True)


def _sequences(root: Path) -> dict[str, int]:
    """Publication sequence of every visible directory that holds a checkpoint manifest."""
    out: dict[str, int] = {}
    if not root.is_dir():
        return out
    for entry in root.iterdir():
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        file = entry / CHECKPOINT_MANIFEST
        try:
            doc = json.loads(file.read_bytes())
            if doc.get("format") == FORMAT and isinstance(doc.get("sequence"), int):
                out[entry.name] = doc["sequence"]
        except (OSError, ValueError, AttributeError):
            continue
    return out


def _next_sequence(root: Path) -> int:
    return max(_sequences(root).values(), default=-1) + 1


def _read_latest_name(root: Path) -> str | None:
    file = root / LATEST
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file} cannot be read ({exc}); resume with --from PATH") from None
    name = text.strip()
    try:
        _check_name(name)
    except CheckpointError:
        raise CheckpointError(
            f"{file} holds {text!r}, not a checkpoint name; resume with --from PATH"
        ) from None
    return name


def _check_name(name: str) -> None:
    if (
        not name
        or name.startswith(".")
        or name == LATEST
        or "/" in name
        or "\\" in name
        or name != name.strip()
    ):
        raise CheckpointError(
            f"checkpoint name {name!r} is not allowed; use a plain name such as 'step_000100'"
        )


def _check_part_name(part: str) -> None:
    if part in (MODEL_PART, "manifest") or not part.replace("_", "").replace("-", "").isalnum():
        raise CheckpointError(
            f"checkpoint part name {part!r} is not allowed; use letters, digits, '_' or '-' "
            "(and not 'model' or 'manifest')"
        )


def _check_filename(filename: str, *, allow_subdir: bool = False) -> None:
    parts = filename.split("/") if allow_subdir else [filename]
    if len(parts) > 2 or "\\" in filename or any(
        not p or p.startswith(".") and p != ".metadata" or "/" in p for p in parts
    ):
        raise ValueError(f"file name {filename!r} escapes the checkpoint directory")


def _dist_part(filename: str) -> str:
    """The state part a multi-rank checkpoint file holds (for ``verify``'s report)."""
    if filename.startswith("dcp/"):
        return "model+optimizer " + filename.removeprefix("dcp/").lstrip(".")
    if filename.startswith("rank-"):
        return "rng+data (" + filename.removesuffix(".pt") + ")"
    return "scheduler+scaler+progress" if filename == "common.pt" else "?"
