"""S5 for MASS (R9): a MASS run killed twice and resumed ends bitwise where the straight
run ends, through the real command line (``families.test_family_kill_resume``'s
harness: its launches cycle ``OMP_NUM_THREADS`` unset, 1 and 2, so the lineage
crosses thread counts), because every piece's fragment and replacements come from a
generator addressed by ``(seed, epoch, example id, piece)``. A resume without its data
cursor differs. Negative control: the same compiler drawing from one process-wide
stream (seeded, so a straight run is still reproducible) no longer resumes bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families.corruption_support import bitwise_s5, unaddressed_differences

pytestmark = pytest.mark.slow

#: MASS on the harness's tiny run: half of every piece is a drawn fragment, 80/10/10.
MASS = {"objective.family": "mass"}


def test_killed_and_resumed_mass_run_is_bitwise_identical_s5(tmp_path: Path) -> None:
    straight, manifest = bitwise_s5(tmp_path, MASS)
    assert manifest["config"]["objective"]["family"] == "mass"
    assert manifest["objective"]["family"] == "mass"
    assert manifest["config"]["mass"]["fraction"] == 0.5
    summary = json.loads((straight / "summary.json").read_text())
    assert summary  # the run finished and summarised


def test_negative_control_unaddressed_draws_do_not_resume_bitwise(tmp_path: Path) -> None:
    differences = unaddressed_differences(tmp_path, MASS, "mass")
    assert any(d.startswith("model.") for d in differences)
