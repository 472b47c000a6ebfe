"""The Python API table is a promise: every name imports as written (X2).

The table moved from the README to the documentation site's page
``docs/guides/python.md`` (under its title "Use the stages from Python"); the README
links to it.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guides" / "python.md"
TITLE = "# Use the stages from Python"
ROW = re.compile(r"^\| [a-z]+ \| `(exactstep[a-z_.]*)` \| (.+) \|$")


def api_table(text: str) -> list[tuple[str, str]]:
    """(module, name) for every name in the table under the page's title."""
    section = text.split(TITLE, 1)[1].split("\n## ", 1)[0]
    pairs = []
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            module, names = match.groups()
            pairs += [(module, name) for name in re.findall(r"`([A-Za-z_]+)`", names)]
    return pairs


PAIRS = api_table(PAGE.read_text(encoding="utf-8"))


def test_the_table_is_found_and_covers_every_stage() -> None:
    modules = {module for module, _ in PAIRS}
    assert {"exactstep.data", "exactstep.rows", "exactstep.model", "exactstep.objective",
            "exactstep.update", "exactstep.parallel", "exactstep.state"} <= modules
    assert len(PAIRS) >= 40


@pytest.mark.parametrize(("module", "name"), PAIRS, ids=[f"{m}.{n}" for m, n in PAIRS])
def test_every_name_in_the_api_table_imports_as_written(module: str, name: str) -> None:
    assert getattr(importlib.import_module(module), name) is not None


def test_the_reader_catches_a_name_that_does_not_import() -> None:
    """Negative control: a table naming a missing function is caught."""
    text = f"{TITLE}\n\n| data | `exactstep.data` | `load_corpus`, `no_such_name` |\n"
    pairs = api_table(text)
    assert pairs == [("exactstep.data", "load_corpus"), ("exactstep.data", "no_such_name")]
    with pytest.raises(AttributeError):
        test_every_name_in_the_api_table_imports_as_written(*pairs[1])


@pytest.mark.parametrize("package", ["data", "rows", "model", "objective", "update",
                                     "parallel", "state"])
def test_every_stage_package_exports_what_it_lists(package: str) -> None:
    module = importlib.import_module(f"exactstep.{package}")
    assert module.__all__, package
    for name in module.__all__:
        assert getattr(module, name) is not None, f"exactstep.{package}.{name}"


@pytest.mark.parametrize("package", ["data", "rows", "model", "objective", "update",
                                     "parallel", "state"])
def test_no_exported_name_is_shadowed_by_a_submodule(package: str) -> None:
    """Importing every submodule first (as a long-running process will) must not turn an
    exported function into the module of the same name."""
    import pkgutil
    import types

    module = importlib.import_module(f"exactstep.{package}")
    for info in pkgutil.iter_modules(module.__path__):
        importlib.import_module(f"exactstep.{package}.{info.name}")
    for name in module.__all__:
        assert not isinstance(getattr(module, name), types.ModuleType), f"{package}.{name}"
