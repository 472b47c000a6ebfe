"""Test modules have unique basenames: the suite has no ``__init__.py`` files, so
pytest imports each test module by its basename, and two modules of one name in two
folders stop the whole run at collection ("import file mismatch")."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def repeated_basenames(paths: list[Path]) -> list[str]:
    counts = Counter(p.name for p in paths if p.name != "conftest.py")
    return sorted(name for name, n in counts.items() if n > 1)


def test_every_test_module_basename_is_unique() -> None:
    assert repeated_basenames(sorted(TESTS.rglob("*.py"))) == []


def test_a_repeated_basename_is_found() -> None:
    """Negative control: the collision this guards against."""
    paths = [Path("docs/test_reference.py"), Path("objective/test_reference.py"),
             Path("a/conftest.py"), Path("b/conftest.py")]
    assert repeated_basenames(paths) == ["test_reference.py"]
