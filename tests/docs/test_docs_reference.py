"""The generated reference cannot drift (X2): every configuration key, every CLI
command and flag and every exported name appears in what docs/hooks/reference.py
writes, compared with the live dataclasses, parsers and ``__all__``.

The expectations come from other readers than the generator's: the keys from
``exactstep.config.config_keys`` (and the keys a ``load_config`` accepts), the flags
from argparse's own ``--help`` text, the ranges from ``load_config`` refusing a value
just outside the range the page states. Negative controls show each comparison fails
on a page with one entry removed.
"""

from __future__ import annotations

import argparse
import importlib
import re

import pytest
from docs_support import hook

from exactstep.cli import build_parser
from exactstep.config import config_keys, load_config
from exactstep.errors import ConfigError
from exactstep.ranges import Range

REF = hook()


def keys_in_table(table: str) -> set[str]:
    return set(re.findall(r"^\| `([a-z0-9_.]+)` \|", table, re.M))


def missing_keys(table: str) -> set[str]:
    return {key for key, _, _ in config_keys()} - keys_in_table(table)


def test_every_config_key_is_in_the_reference_with_a_meaning() -> None:
    table = REF.config_table()
    live = {key for key, _, _ in config_keys()}
    assert len(live) >= 100
    assert keys_in_table(table) == live
    rows = REF.config_rows()
    assert [r["key"] for r in rows if not r["meaning"].strip()] == []
    for r in rows:  # the default shown is the default a load_config() gives
        section, _, name = r["key"].rpartition(".")
        node = load_config()
        for part in filter(None, section.split(".")):
            node = getattr(node, part)
        shown = r["default"]
        assert shown == ("unset" if getattr(node, name) is None
                         else repr(getattr(node, name)).replace("'", '"')), r["key"]


def test_every_config_key_has_a_meaning_of_its_own() -> None:
    """X1: each key's meaning is its entry in docs/hooks/meanings.toml; the table has no
    fallback (a docstring sentence) that would let a key added without one pass."""
    assert REF.keys_without_meaning(REF.meanings()["config"]) == []
    assert not hasattr(REF, "docstring_meaning")


def test_a_key_without_a_meaning_is_caught() -> None:
    """Negative control: the meanings with one entry removed, or emptied, report exactly
    that key, and the table is not built without it (``make docs`` fails naming it)."""
    notes = dict(REF.meanings()["config"])
    del notes["update.lr"]
    assert REF.keys_without_meaning(notes) == ["update.lr"]
    assert REF.keys_without_meaning({**REF.meanings()["config"], "model.lora.r": " "}) == [
        "model.lora.r"]
    with pytest.raises(ValueError, match=r"update\.lr.*docs/hooks/meanings\.toml"):
        REF.config_rows(notes)


def test_meanings_name_no_key_that_is_gone() -> None:
    live = {key for key, _, _ in config_keys()}
    assert set(REF.meanings()["config"]) - live == set()


def test_a_key_left_out_of_the_table_is_caught() -> None:
    """Negative control: the table with one row removed misses exactly that key."""
    table = REF.config_table()
    trimmed = "\n".join(line for line in table.splitlines()
                        if not line.startswith("| `update.lr` |"))
    assert missing_keys(table) == set()
    assert missing_keys(trimmed) == {"update.lr"}


def test_each_stated_range_is_the_range_load_config_enforces() -> None:
    """For every key with a stated interval, a value just outside a bound is refused
    by ``load_config`` naming the key, and the bound itself (when closed) is accepted."""
    ranges = REF.checked_ranges()
    assert {"update.lr", "batch.seq_len", "train.steps", "data.val_fraction"} <= set(ranges)
    kinds = {key: kind for key, _, kind in config_keys()}
    checked = 0
    for key, allowed in ranges.items():
        assert isinstance(allowed, Range)
        row = next(r for r in REF.config_rows() if r["key"] == key)
        assert row["valid"] == str(allowed)
        if allowed.low is None or abs(allowed.low) > 1e15:
            continue
        step = 1 if kinds[key] == "int" else 1e-9 * max(1.0, abs(allowed.low))
        outside = allowed.low - (0 if allowed.low_open else step)
        if kinds[key] == "int" and allowed.low_open:
            outside = int(allowed.low)
        value = str(int(outside)) if kinds[key] == "int" else repr(float(outside))
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, [f"{key}={value}"])
        checked += 1
    assert checked >= 30


def help_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags argparse's own usage line lists (every option, help aside): each
    ``[--flag`` and each required ``--flag`` standing alone."""
    usage = " ".join(parser.format_usage().split())
    return set(re.findall(r"(?:(?<=\[)|(?<= ))(--?[a-z][a-z0-9-]*)", usage)) - {"-h", "--help"}


def commands_from_help(parser: argparse.ArgumentParser, words=()) -> dict[tuple, set[str]]:
    """command words -> flags, read from each parser's own formatted help."""
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(commands_from_help(sub, words + (name,)))
    if not out and words:
        out[words] = help_flags(parser)
    return out


def page_commands(page: str) -> dict[tuple, set[str]]:
    out = {}
    for section in ("\n" + page).split("\n## `exactstep ")[1:]:
        words = tuple(section.split("`", 1)[0].split())
        table = section.split("```\n", 2)[-1]
        out[words] = set(re.findall(r"^\| `(--[a-z0-9-]+)", table, re.M))
    return out


def test_every_command_and_flag_is_in_the_reference() -> None:
    expected = commands_from_help(build_parser())
    assert {("train",), ("resume",), ("checkpoint", "verify"), ("tokenizer", "train"),
            ("config",)} <= set(expected)
    assert "--nproc" in expected[("train",)] and "--set" in expected[("train",)]
    assert page_commands(REF.cli_page()) == expected


def test_a_flag_left_out_of_the_reference_is_caught() -> None:
    """Negative control: a page without the train command's --out row differs."""
    page = REF.cli_page()
    head, tail = page.split("\n## `exactstep resume`", 1)
    trimmed = head.replace("| `--out` `", "| dropped `").replace("| `--out` |", "| dropped |")
    trimmed += "\n## `exactstep resume`" + tail
    assert page_commands(trimmed) != commands_from_help(build_parser())


@pytest.mark.parametrize("package", list(REF.API_PACKAGES))
def test_every_exported_name_is_in_the_api_reference(package: str) -> None:
    page = REF.api_page()
    module = importlib.import_module(package)
    for name in module.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(module, name)
        shown = (f"::: {obj.__module__}.{obj.__qualname__}\n" in page
                 if hasattr(obj, "__qualname__") and callable(obj) else False)
        assert shown or f"- `{package}.{name}`:" in page, f"{package}.{name}"


def test_the_api_reference_covers_the_stage_packages() -> None:
    assert {"exactstep.data", "exactstep.rows", "exactstep.model", "exactstep.objective",
            "exactstep.update", "exactstep.parallel", "exactstep.state"} <= set(
        REF.API_PACKAGES)
