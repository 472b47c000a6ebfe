"""Configuration of the data stage (sources, split, tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where examples come from.

    ``source``: ``"stdlib"`` (the Python standard library's own source files, one
    document per file) or a path to a JSONL file of ``{"text": ...}`` lines (or
    ``{"messages": [...]}`` lines when ``kind = "chat"``). ``val_fraction`` of the
    documents, chosen by a hash of each document's name, form the validation split.
    ``max_docs`` (0 = all) caps the number of documents read, for quick runs.
    """

    source: str = "stdlib"
    kind: Literal["text", "chat"] = "text"
    val_fraction: float = 0.05
    max_docs: int = 0
    tokenizer: Literal["bytes"] = "bytes"

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data.source must be 'stdlib' or a path to a .jsonl file")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1); got {self.val_fraction}")
        if self.max_docs < 0:
            raise ConfigError("data.max_docs must be >= 0 (0 = all documents)")
