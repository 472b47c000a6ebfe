"""S5 needs addressed draws (R9): BART runs resume bitwise because every piece's noise
comes from a generator addressed by ``(seed, epoch, example id, piece)``, consumed in
composition order. Through the real command line, a run straight and the same run
SIGKILLed inside a window and again while a later window runs, resumed each time,
end with byte-identical checkpoints, ledgers and manifests (a resume without the data
cursor differs). Negative control: the same compiler drawing every piece's noise from
one process-wide stream (seeded, so a straight run is still reproducible) no longer
resumes bitwise -- the restarted process draws other noise for the pieces to come.

Uses the launchers of ``state.test_kill_resume`` and ``families.test_family_kill_resume``
(through ``corruption_support``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from families.corruption_support import bitwise_s5, unaddressed_differences

pytestmark = pytest.mark.slow

#: Every draw kind matters: a permutation, Poisson spans, uniform masks, a rotation.
BART = {"objective.family": "bart",
        "bart.noise": "sentence_permutation,text_infilling,token_masking,document_rotation"}


def test_killed_and_resumed_bart_run_is_bitwise_identical_s5(tmp_path: Path) -> None:
    _, manifest = bitwise_s5(tmp_path, BART)
    assert manifest["config"]["objective"]["family"] == "bart"
    assert manifest["objective"]["noise"] == BART["bart.noise"].split(",")


def test_unaddressed_noise_does_not_resume_bitwise(tmp_path: Path) -> None:
    differences = unaddressed_differences(tmp_path, BART, "bart")
    assert any(d.startswith("model.") for d in differences)
