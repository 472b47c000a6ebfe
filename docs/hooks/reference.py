"""The generated reference: configuration keys, CLI commands, run-directory files, API.

A mkdocs hook (``hooks:`` in mkdocs.yml). A page holding ``<!-- generated: NAME -->``
gets that comment replaced at build time by a table produced from the live code:
``config`` from the config dataclasses (type, default) and the ranges their
``__post_init__`` checks (``exactstep.ranges``), ``cli`` from ``exactstep.cli.build_parser``,
``run-directory`` and the keys' meanings from ``docs/hooks/meanings.toml``, ``api``
from the ``__all__`` of each package (rendered by mkdocstrings). Nothing is listed by
hand here, so a new key, flag or exported name appears without editing this file; a
new key's meaning is its own entry in meanings.toml (no fallback: without one the
build fails naming the key). tests/docs/test_docs_reference.py compares the output
with the parsers and dataclasses.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from mkdocs.plugins import event_priority

HERE = Path(__file__).resolve().parent
MEANINGS = HERE / "meanings.toml"
MARK = re.compile(r"<!-- generated: ([a-z-]+) -->")
API_PACKAGES = ("exactstep.data", "exactstep.rows", "exactstep.model",
                "exactstep.objective", "exactstep.update", "exactstep.parallel",
                "exactstep.state", "exactstep")  # the top level last: it re-exports


def meanings() -> dict[str, dict[str, str]]:
    with MEANINGS.open("rb") as fh:
        return tomllib.load(fh)


def cell(text: Any) -> str:
    """``text`` safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


# -- configuration ---------------------------------------------------------------------


def config_sections(cls: type | None = None, prefix: str = "") -> list[tuple[str, type, str]]:
    """Every leaf key as (dotted key, owning dataclass, field name), in declaration order."""
    from exactstep.config import RunConfig

    cls = cls or RunConfig
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            out += config_sections(hints[f.name], prefix + f.name + ".")
        else:
            out.append((prefix + f.name, cls, f.name))
    return out


def checked_ranges() -> dict[str, Any]:
    """key -> ``Range``: every ``ranges.check(key, value, allowed)`` that building the
    default configuration runs, recorded by wrapping ``check`` in each config module."""
    from exactstep import ranges
    from exactstep.config import RunConfig

    seen: dict[str, Any] = {}

    def recorder(key: str, value: Any, allowed: Any) -> None:
        seen[key] = allowed
        ranges.check(key, value, allowed)

    modules = {sys.modules[cls.__module__] for _, cls, _ in config_sections()}
    modules.add(sys.modules[RunConfig.__module__])
    patched = [m for m in modules if getattr(m, "check", None) is ranges.check]
    for module in patched:
        module.check = recorder
    try:
        RunConfig()
    finally:
        for module in patched:
            module.check = ranges.check
    return seen


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        kinds = {type(a).__name__ for a in typing.get_args(hint)}
        return " | ".join(sorted(kinds))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "none"
    if hint is dict or origin is dict:
        return "table"
    return getattr(hint, "__name__", str(hint))


def valid_values(hint: Any, allowed: Any) -> str:
    if allowed is not None:
        return str(allowed)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(hint))
    if hint is bool:
        return "`true` or `false`"
    if hint is float:
        return "a finite number"
    if hint is int:
        return "an integer in [-2**63, 2**63 - 1]"
    return ""


def keys_without_meaning(notes: dict[str, str]) -> list[str]:
    """The configuration keys, in declaration order, that ``notes`` (the ``[config]``
    table of meanings.toml) gives no meaning of their own: every key needs one."""
    return [key for key, _, _ in config_sections() if not str(notes.get(key, "")).strip()]


def config_rows(notes: dict[str, str] | None = None) -> list[dict[str, str]]:
    """One row per configuration key: key, type, default, valid values, meaning.

    ``notes``: the meanings (meanings.toml's ``[config]``); a key without one is a
    ``ValueError`` naming it, so the site is not built with a key left unexplained.
    """
    notes = meanings()["config"] if notes is None else notes
    missing = keys_without_meaning(notes)
    if missing:
        raise ValueError(f"configuration keys without a meaning: {', '.join(missing)}; "
                         "add each to [config] in docs/hooks/meanings.toml")
    ranges_ = checked_ranges()
    rows = []
    for key, cls, name in config_sections():
        hint = typing.get_type_hints(cls)[name]
        default = getattr(cls(), name)
        rows.append({
            "key": key,
            "type": type_name(hint),
            "default": "unset" if default is None else repr(default).replace("'", '"'),
            "valid": valid_values(hint, ranges_.get(key)),
            "meaning": notes[key],
        })
    return rows


def config_table() -> str:
    rows = ["| key | type | default | valid values | meaning |", "|---|---|---|---|---|"]
    for r in config_rows():
        rows.append(f"| `{r['key']}` | {cell(r['type'])} | `{cell(r['default'])}` | "
                    f"{cell(r['valid'])} | {cell(r['meaning'])} |")
    return "\n".join(rows)


# -- command line ----------------------------------------------------------------------


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(command words, parser, help) for every leaf command, in the order declared."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                deeper = subcommands(sub, path + (name,))
                if deeper:
                    out += deeper
                else:
                    out.append((path + (name,), sub, helps.get(name, "")))
    return out


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def cli_commands() -> list[dict[str, Any]]:
    """One entry per command: words, usage, help, and its arguments."""
    from exactstep.cli import build_parser

    out = []
    for words, sub, help_ in subcommands(build_parser()):
        args = []
        for a in flags(sub):
            name = ", ".join(a.option_strings) or (a.metavar or a.dest)
            default = a.default
            if a.required or default in (None, False, []) or not a.option_strings:
                default = ""
            choices = ", ".join(map(str, a.choices)) if a.choices else ""
            args.append({"name": name, "options": list(a.option_strings),
                         "metavar": a.metavar or "", "default": default,
                         "required": bool(a.required) or not a.option_strings,
                         "choices": choices, "help": (a.help or "").replace("%%", "%")})
        usage = " ".join(sub.format_usage().split()).removeprefix("usage: ")
        out.append({"words": words, "usage": usage, "help": help_, "args": args})
    return out


def cli_page() -> str:
    parts = []
    for c in cli_commands():
        parts.append(f"## `exactstep {' '.join(c['words'])}`\n\n{c['help']}\n\n"
                     f"```text\n{c['usage']}\n```\n")
        if c["args"]:
            parts.append("| argument | default | choices | meaning |\n|---|---|---|---|")
            for a in c["args"]:
                default = f"`{a['default']}`" if a["default"] != "" else (
                    "required" if a["required"] else "")
                name = f"`{a['name']}`" + (f" `{a['metavar']}`" if a["options"] and
                                           a["metavar"] else "")
                parts.append(f"| {cell(name)} | {cell(default)} | {cell(a['choices'])} | "
                             f"{cell(a['help'])} |")
            parts.append("")
    return "\n".join(parts)


# -- run directory, API ----------------------------------------------------------------


def run_directory_table() -> str:
    rows = ["| entry | what it holds |", "|---|---|"]
    rows += [f"| `{name}` | {cell(text)} |" for name, text in meanings()["run_directory"].items()]
    return "\n".join(rows)


def api_names() -> dict[str, list[str]]:
    """package -> its ``__all__`` (the public surface; ``__version__`` left out)."""
    return {p: [n for n in importlib.import_module(p).__all__ if not n.startswith("__")]
            for p in API_PACKAGES}


def api_page() -> str:
    """mkdocstrings directives for every exported class and function, each object once
    (a name re-exported by a later package points at the first place it is shown)."""
    parts, shown = [], {}
    for package, names in api_names().items():
        module = importlib.import_module(package)
        parts.append(f"## `{package}`\n")
        first = (inspect.getdoc(module) or "").split("\n\n")[0]
        parts.append(" ".join(first.split()) + "\n")
        others = []
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                path = f"{obj.__module__}.{obj.__qualname__}"
                if path in shown:
                    others.append(f"- `{package}.{name}`: see `{shown[path]}.{name}`")
                    continue
                shown[path] = package
                parts.append(f"::: {path}\n    options:\n      heading_level: 3\n")
            else:
                others.append(f"- `{package}.{name}`: a constant (`{type(obj).__name__}`)")
        if others:
            parts.append("Also exported:\n\n" + "\n".join(others) + "\n")
    return "\n".join(parts)


GENERATORS = {"config": config_table, "cli": cli_page,
              "run-directory": run_directory_table, "api": api_page}


@event_priority(-100)  # after material's offline plugin has added its polyfill
def on_config(config: Any) -> Any:
    """No script from another host: material's ``offline`` plugin adds a shim loaded
    from a CDN (for search from ``file://``); it is dropped, so the built site makes no
    external request (search works when the site is served)."""
    polyfills = config.extra.get("polyfills", [])
    config.extra["polyfills"] = [u for u in polyfills if not re.match(r"https?://", str(u))]
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARK.sub(lambda m: GENERATORS[m.group(1)](), markdown)
