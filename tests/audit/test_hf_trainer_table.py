"""AUDIT.md's measured table is what ``exactstep audit --target hf-trainer[:COLLATOR]``
measures with the installed transformers (A1). On another transformers version the
table is stale, not wrong: the test then skips and says how to re-measure."""

from __future__ import annotations

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from exactstep.audit.run import audit  # noqa: E402

AUDIT_MD = Path(__file__).resolve().parents[2] / "AUDIT.md"
COLUMNS = {"hf-trainer": 2, "hf-trainer:flattening": 3}  # status columns of the table


def measured_table(text: str) -> tuple[str, dict[str, dict[str, str]]]:
    """(transformers version, {target: {probe: status}}) read from AUDIT.md."""
    version = text.split("transformers ", 1)[1].split()[0].strip("`,")
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
    assert set(TABLE["hf-trainer"]) == set(TABLE["hf-trainer:flattening"])
    assert len(TABLE["hf-trainer"]) == 22 and "FAIL" in TABLE["hf-trainer"].values()


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(COLUMNS))
def test_the_audit_measures_what_audit_md_claims(target: str) -> None:
    if transformers.__version__ != VERSION:
        pytest.skip(f"AUDIT.md was measured on transformers {VERSION}, this is "
                    f"{transformers.__version__}: re-measure with make audit")
    report = audit(target)
    assert {r.probe: r.status for r in report.results} == TABLE[target]
