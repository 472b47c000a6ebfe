"""``make docs`` (X1, X2): the site builds with ``mkdocs build --strict`` (a broken
link, a missing page or a snippet that does not resolve fails it), offline: no
``src`` or ``href`` attribute of the built HTML points at another host (no font,
script, stylesheet, image or analytics from outside). The generated reference in the
built pages names every configuration key and every flag of the live parser.
Negative control: the URL check finds an external script, stylesheet and image.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_support import ROOT

from exactstep.config import config_keys

EXTERNAL = re.compile(r"""\s(?:src|href)\s*=\s*["']?((?:https?:)?//[^"'\s>]+)""", re.I)


def external_urls(html: str) -> list[str]:
    """Every src/href attribute value that leaves the site (http, https or //host)."""
    return EXTERNAL.findall(html)


def test_the_url_check_finds_external_resources() -> None:
    html = ('<script src="https://unpkg.com/x/shim"></script>'
            "<link rel=stylesheet href='//fonts.example.com/css'>"
            '<img alt="" src=http://example.com/a.png>'
            '<a href="../reference/config.html">local</a><script src="assets/x.js"></script>')
    assert external_urls(html) == ["https://unpkg.com/x/shim", "//fonts.example.com/css",
                                   "http://example.com/a.png"]


def offline_search_problems(site: Path) -> list[str]:
    """What keeps search from working when ``site/`` is opened as files (``file://``,
    where a browser refuses to fetch ``search_index.json``): mkdocs-material's offline
    plugin writes the index as ``search/search_index.js`` (``var __index = ...``), which
    the theme's bundle loads under ``file:``, and turns ``use_directory_urls`` off."""
    problems = []
    index = site / "search" / "search_index.js"
    if not index.is_file():
        problems.append("no search/search_index.js (the offline plugin is off)")
    elif not index.read_text(encoding="utf-8").startswith("var __index = "):
        problems.append("search/search_index.js does not define __index")
    bundles = list((site / "assets" / "javascripts").glob("bundle.*.min.js"))
    if not any('location.protocol==="file:"' in b.read_text(encoding="utf-8")
               and "search/search_index.js" in b.read_text(encoding="utf-8") for b in bundles):
        problems.append("the theme's bundle does not load search/search_index.js under file:")
    if not (site / "quickstart.html").is_file():
        problems.append("pages are not .html files (use_directory_urls is on)")
    return problems


def test_the_offline_search_check_finds_a_site_that_needs_a_server(tmp_path) -> None:
    """Negative control: a site built without the offline plugin (the index as JSON
    only, pages as directories) is reported on every count."""
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search_index.json").write_text("{}")
    (tmp_path / "assets" / "javascripts").mkdir(parents=True)
    (tmp_path / "assets" / "javascripts" / "bundle.0.min.js").write_text(
        'fetch(new URL("search/search_index.json"))')
    (tmp_path / "quickstart").mkdir()
    assert offline_search_problems(tmp_path) == [
        "no search/search_index.js (the offline plugin is off)",
        "the theme's bundle does not load search/search_index.js under file:",
        "pages are not .html files (use_directory_urls is on)"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
def test_the_strict_build_has_every_page_and_no_external_url(site: Path) -> None:
    html = sorted(site.rglob("*.html"))
    for page in ("index.html", "quickstart.html", "reference/config.html",
                 "reference/cli.html", "reference/run-directory.html", "reference/api.html",
                 "benchmarks.html", "audit-table.html", "concepts/rows.html",
                 "concepts/window.html", "design/rows.html"):
        assert (site / page).is_file(), page
    assert len(html) >= 30
    leaks = {str(p.relative_to(site)): external_urls(p.read_text(encoding="utf-8"))
             for p in html}
    assert {page: urls for page, urls in leaks.items() if urls} == {}


@pytest.mark.slow
def test_search_works_when_the_site_is_opened_as_files(site: Path) -> None:
    """X1: ``site/index.html`` opened from disk keeps its search (no server needed)."""
    assert offline_search_problems(site) == []
    assert '"location":"quickstart.html' in (site / "search" / "search_index.js").read_text(
        encoding="utf-8")


@pytest.mark.slow
def test_the_built_reference_names_every_key_and_flag(site: Path) -> None:
    from exactstep.cli import build_parser

    config = (site / "reference" / "config.html").read_text(encoding="utf-8")
    assert [k for k, _, _ in config_keys() if f"<code>{k}</code>" not in config] == []
    cli = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    flags = set(re.findall(r"(?:\[| )(--[a-z][a-z0-9-]*)", " ".join(
        " ".join(p.format_usage().split()) for p in walk(build_parser()))))
    assert len(flags) >= 25
    assert [f for f in sorted(flags) if f"<code>{f}</code>" not in cli] == []
    benchmarks = (site / "benchmarks.html").read_text(encoding="utf-8")
    first = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
    assert first in benchmarks


def walk(parser):
    import argparse

    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)
