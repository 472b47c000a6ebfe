"""A small deterministic JSONL text corpus for tests that run the real CLI."""

from __future__ import annotations

import json
from pathlib import Path


def write_corpus(path: Path) -> None:
    """48 short documents of varied length, one ``{"text": ...}`` line each."""
    words = "the quick brown fox jumps over a lazy dog while seven owls watch".split()
    with path.open("w") as fh:
        for i in range(48):
            n = 6 + (i * 7) % 29
            text = " ".join(words[(i * 3 + j * 5) % len(words)] for j in range(n))
            fh.write(json.dumps({"text": f"{i}: {text}."}) + "\n")
