"""The run's append-only ledger: one JSON line per window (U4).

Each line is the window's ``Disposition.ledger_record()`` written as canonical JSON
(sorted keys, compact separators) and flushed at once, so a crash loses at most the
line being written. The ledger is a ``Journal``: each checkpoint records its
``mark()`` (lines, bytes, sha256 of those bytes, S2), and a resume proves the file
still begins with exactly those bytes before dropping what was written after the
checkpoint, so a resumed run's ledger is byte-identical to an uninterrupted one (S5)
and a ledger that lost or changed committed lines is refused, not continued (S8).
"""

from __future__ import annotations

from exactstep.durable import Journal
from exactstep.update.disposition import Disposition


class Ledger(Journal):
    """``ledger.jsonl``: open with ``Ledger.create(path)`` or ``Ledger.open_at(path, mark)``."""

    def append(self, entry: Disposition | dict) -> None:
        record = entry.ledger_record() if isinstance(entry, Disposition) else entry
        super().append(record)

    @property
    def position(self) -> int:
        """Complete lines written so far."""
        return self.lines
