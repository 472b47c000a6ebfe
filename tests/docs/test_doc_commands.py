"""Commands in the documentation are promises (X1, X2): every command in a shell block
marked ``<!-- runnable -->`` on a docs page, and in every shell block of the README,
parses with the live argument parser; every ``--set key=...`` names a real
configuration key; every ``--config`` file and ``make`` target exists. The README is
a first visit (at most 150 lines) whose every relative link resolves.
Negative controls: a misspelt flag, an unknown key, a missing config file and a
dangling link are each caught.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from docs_support import ROOT, command_lines, exactstep_argv, pages, runnable_blocks

from exactstep.cli import build_parser
from exactstep.config import RunConfig, config_keys
from exactstep.errors import ConfigError

README = ROOT / "README.md"
KEYS = {key for key, _, _ in config_keys()}
TABLES = {key for key, _, kind in config_keys() if kind == "dict"}
MAKE_TARGETS = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))


def readme_blocks() -> list[str]:
    return re.findall(r"```(?:sh|bash)\n(.*?)\n```", README.read_text(encoding="utf-8"), re.S)


def documented_commands() -> list[tuple[str, str]]:
    """(where, command line) for every command the docs ask a user to run."""
    out = []
    for page in pages():
        for block in runnable_blocks(page.read_text(encoding="utf-8")):
            out += [(str(page.relative_to(ROOT)), line) for line in command_lines(block)]
    out += [("README.md", line) for block in readme_blocks() for line in command_lines(block)]
    return out


COMMANDS = documented_commands()
SECTIONS = {key.rpartition(".")[0] for key in KEYS} - {""}


def set_keys(item: str) -> list[str]:
    """The keys one ``--set`` item names: ``key=value`` names ``key``; a section given a
    JSON object (``model.lora={"r": 4}``) names each key inside it, in full."""
    key, _, value = item.partition("=")
    if key not in SECTIONS:
        return [key]
    try:
        table = json.loads(value)
    except json.JSONDecodeError:
        return [key]
    return [key] if not isinstance(table, dict) else leaf_keys(key, table)


def leaf_keys(prefix: str, table: dict) -> list[str]:
    out = []
    for name, value in table.items():
        key = f"{prefix}.{name}"
        out += leaf_keys(key, value) if key in SECTIONS and isinstance(value, dict) else [key]
    return out


def problems(line: str) -> list[str]:
    """What is wrong with one documented command line (empty when it is right)."""
    words = shlex.split(line)
    if words[:1] == ["make"]:
        return [f"no make target {t!r}" for t in words[1:]
                if "=" not in t and t not in MAKE_TARGETS]
    argv = exactstep_argv(line)
    if argv is None:
        return []
    try:
        args = build_parser().parse_args(argv)
    except (ConfigError, SystemExit) as exc:
        return [f"does not parse: {exc}"]
    found = []
    for item in getattr(args, "overrides", None) or []:
        for key in set_keys(item):
            if key not in KEYS and not any(key.startswith(t + ".") for t in TABLES):
                found.append(f"--set {key}: no such configuration key")
    config = getattr(args, "config", None)
    if config and not (ROOT / config).is_file():
        found.append(f"--config {config}: no such file")
    return found


def test_the_docs_hold_runnable_commands_of_every_main_use() -> None:
    lines = [line for _, line in COMMANDS]
    for needed in ("make train", "exactstep resume", "exactstep eval", "exactstep export",
                   "exactstep audit", "exactstep prepare", "exactstep inspect",
                   "exactstep train --nproc", "torchrun"):
        assert any(line.startswith(needed) for line in lines), needed
    quickstart = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    assert len(runnable_blocks(quickstart)) == 1


@pytest.mark.parametrize(("where", "line"), COMMANDS, ids=[f"{w}:{i}" for i, (w, _) in
                                                            enumerate(COMMANDS)])
def test_every_documented_command_parses(where: str, line: str) -> None:
    assert problems(line) == [], where


def test_a_wrong_command_is_caught() -> None:
    """Negative controls: each kind of mistake is reported."""
    assert problems("exactstep train --out runs/x --set update.lr=1e-3") == []
    assert problems("exactstep train --no-such-flag")[0].startswith("does not parse")
    assert problems("exactstep train --set update.learning_rate=1e-3") == [
        "--set update.learning_rate: no such configuration key"]
    assert problems("exactstep train --config configs/none.toml") == [
        "--config configs/none.toml: no such file"]
    assert problems("make no-such-target") == ["no make target 'no-such-target'"]
    assert problems("exactstep train --set model.hf_config.num_hidden_layers=2") == []
    assert problems("""exactstep train --set 'model={"lora": {"r": 4}, "n_layers": 2}'""") == []
    assert problems("""exactstep train --set 'model={"lora": {"rank": 4}}'""") == [
        "--set model.lora.rank: no such configuration key"]
    assert RunConfig is not None


def relative_links(text: str) -> list[str]:
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [link.split("#")[0] for link in links
            if not re.match(r"[a-z]+:", link) and not link.startswith("#")]


def dangling(text: str, base: Path) -> list[str]:
    return [link for link in relative_links(text) if not (base / link).exists()]


def test_the_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    links = relative_links(text)
    assert len(links) >= 10 and "docs/quickstart.md" in links
    assert dangling(text, ROOT) == []


def test_a_dangling_link_is_caught() -> None:
    """Negative control: a link to a page that does not exist is reported."""
    text = "see [the guide](docs/guides/none.md) and [start](docs/quickstart.md#top)"
    assert dangling(text, ROOT) == ["docs/guides/none.md"]
