"""Every module opens with a short purpose paragraph (DESIGN): the why and the
measurements live in ``docs/design/``, the pictures in ``docs/concepts/``. Held here as
numbers: a docstring on every module, the median at most 8 lines, none over 25, and
every ``docs/design/`` or ``docs/concepts/`` page a docstring points to exists (with
the anchor it names)."""

from __future__ import annotations

import ast
import re
import statistics
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "exactstep"
ROOT = PACKAGE.parents[1]
POINTER = re.compile(r"docs/(design|concepts)/([\w.-]+\.md)(?:#([\w-]+))?")


def docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return 0 if doc is None else len(doc.strip("\n").splitlines())


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_short_purpose_paragraph():
    counts = {str(p.relative_to(PACKAGE)): docstring_lines(p) for p in modules()}
    assert [m for m, n in counts.items() if n == 0] == []
    assert {m: n for m, n in counts.items() if n > 25} == {}
    assert statistics.median(counts.values()) <= 8


def anchors_of(page: Path) -> set[str]:
    """The ids a Markdown page offers: explicit ``<a id>`` anchors and the slugs of
    its headings (lower case, punctuation dropped, spaces as hyphens)."""
    text = page.read_text(encoding="utf-8")
    ids = set(re.findall(r'<a id="([\w-]+)"', text))
    for heading in re.findall(r"^#+\s+(.+)$", text, re.M):
        ids.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", heading.lower()).strip()))
    return ids


def test_every_design_pointer_leads_to_a_page_and_an_anchor():
    missing = []
    for path in modules():
        for folder, page, anchor in POINTER.findall(path.read_text(encoding="utf-8")):
            target = ROOT / "docs" / folder / page
            if not target.is_file():
                missing.append(f"{path.relative_to(PACKAGE)} -> {page}")
            elif anchor and anchor not in anchors_of(target):
                missing.append(f"{path.relative_to(PACKAGE)} -> {page}#{anchor}")
    assert missing == []


def test_the_measures_can_fail(tmp_path):
    """Negative controls: a long docstring is counted as long, and a heading slug is
    what the pointer check compares."""
    module = tmp_path / "m.py"
    module.write_text('"""' + "line\n" * 30 + '"""\n')
    assert docstring_lines(module) == 30
    page = tmp_path / "p.md"
    page.write_text("## rows/packing.py — the plan (R4)\n")
    assert "rowspackingpy--the-plan-r4" in anchors_of(page)
    assert "rowspackingpy" not in anchors_of(page)
    assert POINTER.findall("Picture: docs/concepts/window.md.") == [("concepts", "window.md", "")]
