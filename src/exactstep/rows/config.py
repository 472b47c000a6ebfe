"""Configuration of the rows stage: the ``batch`` section (R1-R4, R7).

``BatchConfig``: row length and count, the boundary and position policies (R3), the
over-long outcome and the packer's buffer (R4), and whether batches are checked (R7).
``run_section`` reads another section of the run's configuration, typed, without a default.
Design and derivations: docs/design/rows.md#rowsconfigpy (R1-R4, R7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from exactstep.errors import MissingSectionError
from exactstep.ranges import at_least, check

S = TypeVar("S")


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How documents become rows (R1-R4).

    ``seq_len`` tokens per row, ``rows`` rows per microbatch. ``boundary``: whether a
    target that crosses a document boundary is ignored (default) or kept.
    ``positions``: restart at 0 per document (default) or continue along the row.
    ``overlong``: what happens to a document longer than a row. ``buffer``: how many
    documents the best-fit-decreasing packer considers at once (bounded memory).
    """

    seq_len: int = 256
    rows: int = 16
    boundary: Literal["ignore", "keep"] = "ignore"
    positions: Literal["reset", "continue"] = "reset"
    overlong: Literal["split", "truncate", "drop"] = "split"
    buffer: int = 512
    check_invariants: bool = True

    def __post_init__(self) -> None:
        check("batch.seq_len", self.seq_len, at_least(2))
        check("batch.rows", self.rows, at_least(1))
        check("batch.buffer", self.buffer, at_least(1))


def run_section(cfg: Any, key: str, kind: type[S]) -> S:
    """``cfg.<key>``, checked to be a ``kind``: how a stage below ``config`` (which cannot
    name ``RunConfig``) reads a section of the run's configuration. A configuration
    without it is a ``MissingSectionError`` naming the key, never a default in its place."""
    value = getattr(cfg, key, None)
    if not isinstance(value, kind):
        raise MissingSectionError(key, kind.__name__)
    return value
