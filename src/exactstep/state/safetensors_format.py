"""The one-process checkpoint format: safetensors weights plus one file per part (S2).

``publish_checkpoint`` writes a run's state into a ``state.store`` publication and
commits it (S3); ``load_checkpoint`` verifies every digest before deserialising
anything (S6). Multi-rank jobs use ``parallel.dcp_format`` instead (S7).
Design and derivations: docs/design/state.md#statesafetensors_formatpy (S2, S3, S6).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from exactstep.errors import CheckpointError
from exactstep.state.store import (
    Publication,
    check_files,
    read_checkpoint_manifest,
)

FORMAT = "exactstep-checkpoint/2"
MODEL_FILE = "model.safetensors"
MODEL_PART = "model"
LAYOUT_KEY = "exactstep.layout"


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

    The previous committed checkpoint is untouched until the new one is published;
    a directory already holding ``name`` is kept when it verifies as exactly this
    checkpoint and quarantined otherwise (S8). A failed write raises
    ``StorageError`` and leaves nothing behind. Returns ``root/<name>``.
    """
    for part in parts:
        _check_part_name(part)
    with Publication(root, name) as publication:
        part_files = {MODEL_PART: MODEL_FILE}
        _write_model(publication.directory / MODEL_FILE, model_state)
        publication.add(MODEL_FILE)
        for part, value in parts.items():
            part_files[part] = _write_part(publication, part, value)
        return publication.commit(format=FORMAT, parts=part_files, keep=keep)


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


def _write_part(publication: Publication, part: str, value: Any) -> str:
    """Write one part and seal it; returns its file name (``.json`` or ``.pt``)."""
    as_json = _lossless_json(value)
    if as_json is not None:
        filename = f"{part}.json"
        publication.write(filename, as_json)
    else:
        filename = f"{part}.pt"
        with open(publication.directory / filename, "wb") as fh:
            torch.save(value, fh)
        publication.add(filename)
    return filename


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
    manifest = read_checkpoint_manifest(path)
    if manifest["format"] != FORMAT or manifest["parts"].get(MODEL_PART) != MODEL_FILE:
        raise CheckpointError(
            f"{path} holds a {manifest['format']!r} checkpoint, not {FORMAT!r}"
        )
    check_files(path, manifest, None if verify else [])
    for filename in manifest["parts"].values():
        if not (path / filename).is_file():
            raise CheckpointError(
                f"checkpoint file {path / filename} is missing; the checkpoint is incomplete, "
                "resume from an earlier one with --from"
            )
    model_state = load_model_file(path / MODEL_FILE)
    parts: dict[str, Any] = {}
    for part, filename in manifest["parts"].items():
        if part != MODEL_PART:
            parts[part] = _load_part(path / filename)
    return model_state, parts


def read_part(path: Path, part: str) -> Any:
    """One part of a checkpoint, its file verified first (S6); e.g. ``progress``."""
    path = Path(path)
    manifest = read_checkpoint_manifest(path)
    filename = manifest["parts"].get(part)
    if filename is None:
        raise CheckpointError(f"checkpoint {path} has no part {part!r}")
    check_files(path, manifest, [filename])
    return _load_part(path / filename)


def load_model_file(file: Path) -> dict[str, torch.Tensor]:
    """The model state of a ``model.safetensors`` written here (aliases restored)."""
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


def _check_part_name(part: str) -> None:
    if part in (MODEL_PART, "manifest") or not part.replace("_", "").replace("-", "").isalnum():
        raise CheckpointError(
            f"checkpoint part name {part!r} is not allowed; use letters, digits, '_' or '-' "
            "(and not 'model' or 'manifest')"
        )
