"""S5 for T5 span corruption through the real command line (R8, S5): a span run
(``objective.family = span``) run straight, against the same run SIGKILLed inside a
window (after its update, before its ledger line) and from outside while a later
window runs, resumed with ``exactstep resume`` each time. The final checkpoints hold
bitwise-identical state and the ledgers and manifests are identical: the corruption
of every piece is drawn from a generator addressed by the piece, so a resumed stream
compiles the same corrupted rows with nothing saved but the planner's cursor.

Negative controls: a resume that drops the data cursor ends with other weights; and a
compiler that draws every corruption from one process-wide stream instead (seeded,
so a straight run is still reproducible) no longer resumes bitwise -- the restarted
process draws other corruptions for the same pieces.

It reuses the launcher and helpers of ``test_kill_resume``; only the family differs.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from state.test_kill_resume import LAUNCHER, Harness, final_state, killed, ledger_lines
from text_corpus import write_whole

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

SHARED_STREAM = '''
if defect == "shared_span_stream":  # every piece's corruption from one process-wide stream
    import exactstep.rows.span as span_rows
    shared = np.random.default_rng(0)
    span_rows.piece_generator = lambda *address: shared
'''
SPAN_LAUNCHER = LAUNCHER.replace("from exactstep.cli import main", SHARED_STREAM
                                 + "from exactstep.cli import main")
SPAN = ["--set", "objective.family=span", "--set", "span.sentinels=8"]


class SpanHarness(Harness):
    """``Harness`` whose new runs train the span family."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.launcher = root / "span_launch.py"
        write_whole(self.launcher, SPAN_LAUNCHER)

    def train(self, run_dir: Path, **kw) -> int:
        from state.test_kill_resume import settings

        return self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *settings(self.corpus), *SPAN], run_dir=run_dir, **kw)


def lineage(h: SpanHarness, name: str, defect: str = "none") -> Path:
    """Train, SIGKILL inside window 3, (without ``defect``: resume and SIGKILL from
    outside two ledger lines later,) resume to the end; every process with ``defect``."""
    run_dir = h.root / name
    assert killed(h.train(run_dir, kill_at="window_end:3", defect=defect)), h.last_output
    if defect == "none":
        shutil.copytree(run_dir, h.root / "no_cursor")
        status = h.resume(run_dir, kill_after_lines=ledger_lines(run_dir) + 2)
        assert killed(status), h.last_output
    assert h.resume(run_dir, defect=defect) == 0, h.last_output
    return run_dir


def straight(h: SpanHarness, name: str, defect: str = "none") -> Path:
    run_dir = h.root / name
    assert h.train(run_dir, defect=defect) == 0, h.last_output
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("span-s5")
    SpanHarness(root)  # writes the corpus and the launcher once
    with ThreadPoolExecutor(max_workers=2) as pool:
        a = pool.submit(straight, SpanHarness(root), "straight")
        b = pool.submit(lineage, SpanHarness(root), "killed")
        run_a, run_b = a.result(), b.result()
        control = pool.submit(lambda: SpanHarness(root).resume(root / "no_cursor",
                                                               defect="no_cursor"))
        c = pool.submit(straight, SpanHarness(root), "shared_straight", "shared_span_stream")
        shared_b = lineage(SpanHarness(root), "shared_killed", "shared_span_stream")
        assert control.result() == 0
        shared_a = c.result()
    return run_a, run_b, root / "no_cursor", (shared_a, shared_b)


def test_a_killed_span_run_resumes_bitwise(runs) -> None:
    run_a, run_b, _, _ = runs
    name_a, state_a = final_state(run_a)
    name_b, state_b = final_state(run_b)
    assert name_a == name_b
    assert state_differences(state_a, state_b) == []
    assert (run_a / "ledger.jsonl").read_bytes() == (run_b / "ledger.jsonl").read_bytes()
    assert (run_a / "manifest.json").read_bytes() == (run_b / "manifest.json").read_bytes()
    import json

    objective = json.loads((run_a / "manifest.json").read_text())["manifest"]["objective"]
    assert objective["family"] == "span_corruption"


def test_a_resume_without_the_cursor_fails_the_comparison(runs) -> None:
    run_a, _, control, _ = runs
    differences = state_differences(final_state(run_a)[1], final_state(control)[1])
    assert any(d.startswith("model.") for d in differences)


def test_unaddressed_corruption_does_not_resume_bitwise(runs) -> None:
    _, _, _, (shared_a, shared_b) = runs
    differences = state_differences(final_state(shared_a)[1], final_state(shared_b)[1])
    assert any(d.startswith("model.") for d in differences)
