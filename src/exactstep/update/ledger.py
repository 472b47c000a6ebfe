"""The run's append-only ledger: one JSON line per window (U4).

Each line is the window's ``Disposition.ledger_record()`` written as canonical
JSON (sorted keys, compact separators) and flushed at once, so a crash loses at
most the line being written. ``position`` (complete lines) goes into each
checkpoint (S2); on resume ``truncate_to(position)`` drops every line written
after that checkpoint, including a torn last line, so a resumed run's ledger is
byte-identical to an uninterrupted one (S5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from exactstep.errors import CheckpointError
from exactstep.update.disposition import Disposition


class Ledger:
    """Append-only ``ledger.jsonl``.

    Opening an existing file continues after its last complete line (a torn
    tail is dropped). ``truncate_to`` raises ``CheckpointError`` when the file
    holds fewer lines than the checkpoint recorded.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(exist_ok=True)
        self._position = _count_complete_lines(self.path)
        self.truncate_to(self._position)

    @property
    def position(self) -> int:
        """Complete lines written so far (the checkpointed ledger position)."""
        return self._position

    def append(self, entry: Disposition | dict) -> None:
        record = entry.ledger_record() if isinstance(entry, Disposition) else entry
        line = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(line + "\n")
            fh.flush()
        self._position += 1

    def truncate_to(self, position: int) -> None:
        """Keep exactly the first ``position`` lines (resume, S5)."""
        if position < 0:
            raise CheckpointError(f"ledger position must be >= 0; got {position}")
        data = self.path.read_bytes()
        end = 0
        for _ in range(position):
            newline = data.find(b"\n", end)
            if newline < 0:
                raise CheckpointError(
                    f"{self.path} has fewer than {position} complete lines; the checkpoint "
                    "does not belong to this run directory (resume from a matching one)"
                )
            end = newline + 1
        if end != len(data):
            with self.path.open("r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())
        self._position = position

    def records(self) -> list[dict]:
        """Every complete line, parsed (for reports and tests)."""
        text = self.path.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def _count_complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")
