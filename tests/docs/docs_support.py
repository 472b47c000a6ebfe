"""Shared readers for the documentation tests: the hook module (the generated
reference), the runnable shell blocks of the pages, and their ``exactstep`` commands."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"<!-- runnable -->\n```(?:sh|bash|console)\n(.*?)\n```", re.S)


def hook():
    """docs/hooks/reference.py, imported by path (it is not a package)."""
    spec = importlib.util.spec_from_file_location("docs_reference_hook",
                                                  DOCS / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable_blocks(text: str) -> list[str]:
    """The shell blocks marked ``<!-- runnable -->`` (the comment on the line before)."""
    return FENCE.findall(text)


def command_lines(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blanks dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(shlex.join(words))
    return out


def exactstep_argv(line: str) -> list[str] | None:
    """The argv after ``exactstep`` (also ``python -m exactstep``, ``torchrun ... -m
    exactstep``), or None when the line runs something else."""
    words = shlex.split(line)
    if words and words[0] == "exactstep":
        return words[1:]
    for i in range(len(words) - 1):
        if words[i] == "-m" and words[i + 1] == "exactstep":
            return words[i + 2:]
    return None


def pages() -> list[Path]:
    """Every Markdown page of the site (the design notes included)."""
    return sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)
