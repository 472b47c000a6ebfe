"""S5 for the masked-LM family through the real command line (R8).

``exactstep train --set objective.family=mlm`` (the bidirectional encoder, masks
drawn per piece) run straight, against the same run SIGKILLed inside its fourth
window (after the update, before its ledger line) and resumed with ``exactstep
resume`` from the checkpoint after two windows, so the batches of the last eight
windows are compiled again by a fresh process: the final checkpoints
hold bitwise-identical state, the checkpoint files hash the same, and the ledgers
and manifests are identical. The masks are not in the checkpoint at all: they are
recomputed from ``(seed, epoch, example id, piece)`` after the resume. Negative
control: a resume that drops the data cursor ends with other weights.

It reuses the launcher and helpers of ``test_kill_resume``; only the family differs.
"""

from __future__ import annotations

import copy
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from state.test_kill_resume import Harness, final_state, killed, ledger_lines, settings

from exactstep.state.compare import state_differences
from exactstep.state.store import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

WINDOWS = 10  # test_kill_resume's train.steps


class MLMHarness(Harness):
    """The kill-resume harness training the masked-LM family."""

    def train(self, run_dir: Path, **kw) -> int:
        return self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *settings(self.corpus), "--set", "objective.family=mlm"],
                           run_dir=run_dir, **kw)


def straight_run(h: MLMHarness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def killed_lineage(h: MLMHarness) -> tuple[Path, Path]:
    run_dir = h.root / "killed"
    assert killed(h.train(run_dir, kill_at="window_end:3")), h.last_output
    control = h.root / "no_cursor"
    shutil.copytree(run_dir, control)
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and verify_checkpoint(latest).ok and latest.name.endswith("02")
    assert h.resume(run_dir) == 0, h.last_output
    assert h.resume(control, defect="no_cursor") == 0, h.last_output
    return run_dir, control


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    h = MLMHarness(tmp_path_factory.mktemp("mlm_s5"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        straight = pool.submit(straight_run, copy.copy(h))  # same files, own last_output
        lineage = pool.submit(killed_lineage, copy.copy(h))
        return straight.result(), *lineage.result()


def files_of(run_dir: Path) -> dict:
    path = latest_checkpoint(run_dir / "checkpoints")
    return json.loads((path / "manifest.json").read_bytes())["files"]


def test_a_killed_masked_lm_run_resumes_bitwise_s5(runs):
    straight, run_dir, _ = runs
    name_a, state_a = final_state(straight)
    name_b, state_b = final_state(run_dir)
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    assert state_differences(state_a, state_b) == []
    assert files_of(straight) == files_of(run_dir)
    assert (straight / "ledger.jsonl").read_bytes() == (run_dir / "ledger.jsonl").read_bytes()
    assert ledger_lines(straight) == WINDOWS
    assert (straight / "manifest.json").read_bytes() == (run_dir / "manifest.json").read_bytes()


def test_the_run_is_a_masked_lm_run(runs):
    straight, _, _ = runs
    manifest = json.loads((straight / "manifest.json").read_bytes())["manifest"]
    assert manifest["objective"]["family"] == "masked_lm"
    assert manifest["config"]["mlm"] == {"mask_rate": 0.15, "replace_mask": 0.8,
                                         "replace_random": 0.1}
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["masked_targets"] == summary["heldout_tokens"] > 0
    assert 0.0 <= summary["masked_accuracy"] <= 1.0
    assert summary["masked_targets_mask"] + summary["masked_targets_random"] + \
        summary["masked_targets_keep"] == summary["masked_targets"]


def test_a_resume_without_the_cursor_fails_the_comparison_s5(runs):
    straight, _, control = runs
    differences = state_differences(final_state(straight)[1], final_state(control)[1])
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
