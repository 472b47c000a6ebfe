"""A small deterministic JSONL text corpus for tests that run the real CLI."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path


def write_corpus(path: Path) -> None:
    """48 short documents of varied length, one ``{"text": ...}`` line each.

    Written to a temporary name and renamed, so a process reading ``path`` while
    another thread writes it again never sees a half-written file.
    """
    words = "the quick brown fox jumps over a lazy dog while seven owls watch".split()
    lines = []
    for i in range(48):
        n = 6 + (i * 7) % 29
        text = " ".join(words[(i * 3 + j * 5) % len(words)] for j in range(n))
        lines.append(json.dumps({"text": f"{i}: {text}."}) + "\n")
    write_whole(path, "".join(lines))


def write_whole(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (temporary file, then ``os.replace``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)
