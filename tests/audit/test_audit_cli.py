"""``exactstep audit`` from the command line (A1, X2, X4): the table, one JSON object,
the self-contained HTML report, exit 0 only when every applicable probe passes, and one
``error:`` line with exit 2 for a target that cannot be had."""

from __future__ import annotations

import json

import pytest

from exactstep.audit.probes import PROBES
from exactstep.cli import main

WRONG = "python:audit_wrong_loops:"  # tests/audit is importable under pytest


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_engine_passes_and_json_is_one_object(capsys) -> None:
    code, out, err = run_cli(["audit", "--target", "exactstep", "--json"], capsys)
    assert code == 0, out
    assert len(out.strip().splitlines()) == 1
    report = json.loads(out)
    assert report["ok"] is True and report["target"] == "exactstep"
    assert report["counts"] == {"PASS": 29, "FAIL": 0, "N/A": 2, "ERROR": 0}
    first = report["probes"][0]
    assert {"probe", "contract", "status", "expected", "observed", "fix"} <= set(first)


def test_a_wrong_loop_fails_with_a_fix_line_and_exit_1(capsys) -> None:
    code, out, _ = run_cli(["audit", "--target", WRONG + "DropEos"], capsys)
    assert code == 1
    row = next(line for line in out.splitlines() if line.startswith("eos_target"))
    assert row.split()[1] == "R1" and row.endswith("FAIL")
    assert "fix eos_target (R1): the EOS token must stay a target" in out
    assert out.strip().endswith("NOT CONFORMANT")
    assert "fix eval_rows (L5): evaluate the gold NLL" in out  # its evaluation drops EOS too
    assert sum(line.startswith("fix ") for line in out.splitlines()) == 2


def test_the_html_report_is_self_contained_with_plots(tmp_path, capsys) -> None:
    page = tmp_path / "audit.html"
    code, _, _ = run_cli(["audit", "--target", WRONG + "PerTensorClip", "--report",
                          str(page)], capsys)
    assert code == 1
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>") and text.count("<tr class=") == len(PROBES)
    assert text.count("<svg") >= 10  # one plot per numeric probe
    assert "fix: clip once by the global norm" in text
    # nothing is fetched: the only URL is the SVG namespace
    assert {u.split('"')[0] for u in text.split('"http')[1:]} == {"://www.w3.org/2000/svg"}


def test_one_probe_can_be_run_alone(capsys) -> None:
    code, out, _ = run_cli(["audit", "--target", WRONG + "DropEos", "--probe", "shift"],
                           capsys)
    assert code == 0 and "1 probes, 1 PASS" in out


@pytest.mark.parametrize(("target", "needle"), [
    ("hf", "unknown audit target 'hf'"),
    ("python:no_such_module_here:make", "does not import: ModuleNotFoundError"),
    ("python:audit_wrong_loops:no_such_function", "has no function 'no_such_function'"),
    ("python:audit_wrong_loops", "must read python:MODULE:FUNCTION"),
    ("python:json:dumps", "dumps() raised TypeError"),
    ("python:collections:OrderedDict", "without build, logits, train"),
    ("python:broken_target:make", "does not import: ZeroDivisionError"),
    ("hf-trainer:bogus", "hf-trainer"),  # an unknown collator (or no transformers)
    ("trl-sft:bogus", "trl-sft"),  # an unknown variant (or no trl)
])
def test_a_target_that_cannot_be_had_is_one_error_line(target, needle, tmp_path,
                                                      monkeypatch, capsys) -> None:
    (tmp_path / "broken_target.py").write_text("1 / 0\n")
    monkeypatch.chdir(tmp_path)  # the current directory is importable, as with python -m
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    code, out, err = run_cli(["audit", "--target", target], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err


def test_an_unknown_probe_is_one_error_line(capsys) -> None:
    code, _, err = run_cli(["audit", "--target", "exactstep", "--probe", "bogus"], capsys)
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and "unknown probe 'bogus'" in err
