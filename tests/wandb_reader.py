"""Reads a W&B offline run file (``run-ID.wandb``) back, for the tracking tests.

The file is W&B's 7-byte header (``:W&B``, a 2-byte magic, a version byte) followed
by a LevelDB log: 32 KiB blocks of records, each with a 7-byte header (crc32,
little-endian uint16 length, type: 1 full, 2 first, 3 middle, 4 last); a block tail
shorter than a header is padding. Each record is a ``wandb_internal_pb2.Record``.
wandb 0.31 ships no Python reader of its own (its ``wandb-core`` reads them), so this
follows the documented LevelDB log layout.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
HEADER = 7


def raw_records(path: Path) -> Iterator[bytes]:
    buf = path.read_bytes()
    assert buf[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, parts = HEADER, []
    while pos + HEADER <= len(buf):
        room = BLOCK - pos % BLOCK
        if room < HEADER:
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", buf[pos:pos + HEADER])
        if kind == 0 and length == 0:  # zero padding to the block's end
            pos += room
            continue
        data = buf[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield data
        elif kind == 2:
            parts = [data]
        elif kind == 3:
            parts.append(data)
        elif kind == 4:
            yield b"".join(parts + [data])


def read_run(path: Path) -> dict:
    """``{"config": {...}, "group": str, "name": str, "history": {key: {step: value}}}``."""
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict = {"config": {}, "history": {}}
    for data in raw_records(path):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["group"], out["name"] = record.run.run_group, record.run.display_name
            for item in record.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out["history"].setdefault(key, {})[step] = json.loads(item.value_json)
    return out


def run_files(root: Path) -> list[Path]:
    """Every offline run file under ``root``, oldest first."""
    return sorted(root.glob("wandb/offline-run-*/run-*.wandb"))
