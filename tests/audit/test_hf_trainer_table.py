"""AUDIT.md's measured table is what ``exactstep audit --target hf-trainer[:COLLATOR]``
and ``--target trl-sft[:VARIANT]`` measure with the installed transformers and trl
(A1). On another version the table is stale, not wrong: the test then skips and says
how to re-measure."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from exactstep.audit.run import audit  # noqa: E402

AUDIT_MD = Path(__file__).resolve().parents[2] / "AUDIT.md"
COLUMNS = {"hf-trainer": 2, "hf-trainer:flattening": 3, "trl-sft": 4,  # status columns
           "trl-sft:assistant_only_loss": 5, "trl-sft:padding_free": 6, "trl-sft:packing": 7,
           "hf-trainer:lora": 8}


def measured_table(text: str) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """({package: version}, {target: {probe: status}}) read from AUDIT.md."""
    version = {p: text.split(f"{p} ", 1)[1].split()[0].strip("`,")
               for p in ("transformers", "trl")}
    section = text.split("## Measured", 1)[1].split("\n## ", 1)[0]
    table: dict[str, dict[str, str]] = {t: {} for t in COLUMNS}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            for target, col in COLUMNS.items():
                table[target][cells[0].strip("`")] = cells[col]
    return version, table


VERSION, TABLE = measured_table(AUDIT_MD.read_text(encoding="utf-8"))


def test_the_table_is_read() -> None:
    from exactstep.audit.probes import PROBES

    for target in COLUMNS:
        assert set(TABLE[target]) == {p.name for p in PROBES}, target
        assert "FAIL" in TABLE[target].values()


def installed(package: str) -> str | None:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(COLUMNS))
def test_the_audit_measures_what_audit_md_claims(target: str) -> None:
    if target.endswith(":lora"):
        pytest.importorskip("peft")
    for package in ("transformers",) + (("trl",) if target.startswith("trl") else ()):
        if installed(package) != VERSION[package]:
            pytest.skip(f"AUDIT.md was measured on {package} {VERSION[package]}, this is "
                        f"{installed(package)}: re-measure with make audit")
    report = audit(target)
    assert {r.probe: r.status for r in report.results} == TABLE[target]
