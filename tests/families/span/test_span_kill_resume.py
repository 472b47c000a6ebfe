"""S5 needs addressed draws (R8): span corruption's runs resume bitwise (the span
entry of ``state.test_family_kill_resume``) because every piece's corruption comes
from a generator addressed by ``(seed, epoch, example id, piece)``. Negative control
here: the same compiler drawing every corruption from one process-wide stream
(seeded, so a straight run is still reproducible) no longer resumes bitwise, through
the real command line -- the restarted process draws other corruptions for the
pieces still to come.

Uses the launcher of ``state.test_kill_resume`` with one more defect.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from families.test_family_kill_resume import FAMILIES, FamilyHarness, final_state
from state.test_kill_resume import LAUNCHER
from text_corpus import write_whole

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

SHARED_STREAM = '''
if defect == "shared_span_stream":  # every piece's corruption from one process-wide stream
    import exactstep.families.span.compiler as span_rows
    shared = np.random.default_rng(0)
    span_rows.piece_generator = lambda *address: shared
'''
LAUNCH = "from exactstep.cli import main"
DEFECT = "shared_span_stream"


class SharedStreamHarness(FamilyHarness):
    """The span family's runs, every process with the shared-stream defect."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, FAMILIES["span"])
        self.launcher = root / "shared_stream_launch.py"
        write_whole(self.launcher, LAUNCHER.replace(LAUNCH, SHARED_STREAM + LAUNCH))

    def launch(self, command: list[str], **kw) -> int:
        return super().launch(command, defect=DEFECT, **kw)


def straight(h: SharedStreamHarness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def killed(h: SharedStreamHarness) -> Path:
    run_dir = h.root / "killed"
    assert h.train(run_dir, kill_at="window_end:3") == -signal.SIGKILL, h.last_output
    assert h.resume(run_dir) == 0, h.last_output
    return run_dir


def test_unaddressed_corruption_does_not_resume_bitwise(tmp_path: Path) -> None:
    h = SharedStreamHarness(tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        a, b = pool.submit(straight, h), pool.submit(killed, SharedStreamHarness(tmp_path))
        run_a, run_b = a.result(), b.result()
    differences = state_differences(final_state(run_a)[1], final_state(run_b)[1])
    assert any(d.startswith("model.") for d in differences)
