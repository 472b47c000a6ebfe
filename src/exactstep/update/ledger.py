"""The run's append-only ledger: one JSON line per window (U4).

Each window's ``Disposition`` becomes one canonical JSON line, flushed at once. As a
``Journal`` the ledger is marked by every checkpoint (S2) and cut back to that mark on
resume after proving its bytes, so a resumed ledger is byte-identical to an
uninterrupted one (S5) and a ledger that lost or changed committed lines is refused (S8).
Design and derivations: docs/design/update.md#updateledgerpy (U4, S2, S5, S8).
"""

from __future__ import annotations

from exactstep.state.durable import Journal
from exactstep.update.disposition import Disposition


class Ledger(Journal):
    """``ledger.jsonl``: open with ``Ledger.create(path)`` or ``Ledger.open_at(path, mark)``.

    Each append is one canonical JSON line, flushed at once (a crash loses at most the
    line being written). ``open_at`` continues right after a checkpoint's ``mark()``,
    dropping later bytes; check the mark first (``state.durable.check_mark``): a ledger that
    lost or changed committed lines is refused, not continued (S5, S8).
    """

    def append(self, entry: Disposition | dict) -> None:
        record = entry.ledger_record() if isinstance(entry, Disposition) else entry
        super().append(record)

    @property
    def position(self) -> int:
        """Complete lines written so far."""
        return self.lines
