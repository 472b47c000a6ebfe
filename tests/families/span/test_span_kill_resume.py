"""S5 needs addressed draws (R8): span corruption's runs resume bitwise (the span
entry of ``state.test_family_kill_resume``) because every piece's corruption comes
from a generator addressed by ``(seed, epoch, example id, piece)``. Negative control
here: the same compiler drawing every corruption from one process-wide stream
(seeded, so a straight run is still reproducible) no longer resumes bitwise, through
the real command line -- the restarted process draws other corruptions for the
pieces still to come.

Uses the launcher of ``state.test_kill_resume`` with one more defect
(``corruption_support.shared_stream``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from families.corruption_support import unaddressed_differences
from families.test_family_kill_resume import FAMILIES

pytestmark = pytest.mark.slow


def test_unaddressed_corruption_does_not_resume_bitwise(tmp_path: Path) -> None:
    differences = unaddressed_differences(tmp_path, FAMILIES["span"], "span")
    assert any(d.startswith("model.") for d in differences)
