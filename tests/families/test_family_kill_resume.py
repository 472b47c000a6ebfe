"""S5 for the objective families whose batches or inputs are drawn (R8), through the
real command line: ``exactstep train --set objective.family=F`` run straight, against
the same run SIGKILLed inside a window (after its update, before its ledger line) and
again from outside while a later window runs, resumed each time. The final checkpoint
files, the ledger and the manifest are byte-identical. Negative control: a resume that
drops the data cursor ends with different weights.

Uses the launcher of ``state.test_kill_resume`` (kill moments and defects); each family
adds its own settings to the tiny run there.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from state.test_kill_resume import Harness, settings

from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint, verify_checkpoint

pytestmark = pytest.mark.slow

WINDOWS = 10  # the harness's run length (state.test_kill_resume.WINDOWS)

#: Each family's settings on top of the harness's tiny run; the draws must matter.
FAMILIES = {
    # gold inputs with probability 1/2: about half of the inputs are the model's
    "scheduled_sampling": {"objective.family": "scheduled_sampling",
                           "scheduled_sampling.schedule": "linear",
                           "scheduled_sampling.slope": 0.1, "scheduled_sampling.floor": 0.5},
    # every piece's factorisation order is drawn; half of each order is predicted
    "permutation": {"objective.family": "permutation", "permutation.predict_one_in": 2},
    # every piece's noise spans are drawn; 8 sentinels (a full 32-column row uses 2)
    "span": {"objective.family": "span", "span.sentinels": 8},
    # 15% of every piece selected, 80/10/10, drawn by (seed, epoch, example, piece)
    "mlm": {"objective.family": "mlm"},
}


class FamilyHarness(Harness):
    def __init__(self, root: Path, family: dict) -> None:
        super().__init__(root)
        self.family = family

    def train(self, run_dir: Path, **kw) -> int:
        extra = [arg for k, v in self.family.items() for arg in ("--set", f"{k}={v}")]
        return self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *settings(self.corpus), *extra], run_dir=run_dir, **kw)


def lines(run_dir: Path) -> int:
    return (run_dir / "ledger.jsonl").read_bytes().count(b"\n")


def straight_run(h: FamilyHarness) -> Path:
    run_dir = h.root / "straight"
    assert h.train(run_dir) == 0, h.last_output
    return run_dir


def killed_lineage(h: FamilyHarness) -> tuple[Path, Path]:
    run_dir = h.root / "killed"
    assert h.train(run_dir, kill_at="window_end:3") == -signal.SIGKILL, h.last_output
    defective = h.root / "no_cursor"
    shutil.copytree(run_dir, defective)
    latest = latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and verify_checkpoint(latest).ok
    assert h.resume(run_dir, kill_after_lines=lines(run_dir) + 2) == -signal.SIGKILL, \
        h.last_output
    assert h.resume(run_dir) == 0, h.last_output
    assert h.resume(defective, defect="no_cursor") == 0, h.last_output
    return run_dir, defective


def final_state(run_dir: Path) -> tuple[str, dict, dict]:
    path = latest_checkpoint(run_dir / "checkpoints")
    model, parts = load_checkpoint(path)
    files = json.loads((path / "manifest.json").read_bytes())["files"]
    return path.name, {"model": model, **parts}, files


def check_draws_mattered(name: str, run_dir: Path) -> None:
    """The family's own record that its draws did something in this run."""
    if name == "scheduled_sampling":
        records = [json.loads(x) for x in (run_dir / "ledger.jsonl").read_text().splitlines()]
        assert sum(r["inputs"]["model_inputs"] for r in records) > 0
        assert records[-1]["inputs"]["gold_probability"] == 0.5
    if name == "mlm":
        manifest = json.loads((run_dir / "manifest.json").read_bytes())["manifest"]
        assert manifest["objective"]["family"] == "masked_lm"
        assert manifest["config"]["mlm"] == {"mask_rate": 0.15, "replace_mask": 0.8,
                                             "replace_random": 0.1}
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["masked_targets"] == summary["heldout_tokens"] > 0
        assert summary["masked_targets_mask"] > 0 and 0.0 <= summary["masked_accuracy"] <= 1.0
        assert summary["masked_targets_mask"] + summary["masked_targets_random"] + \
            summary["masked_targets_keep"] == summary["masked_targets"]


def bitwise_lineage(h: Harness, windows: int = WINDOWS) -> tuple[Path, Path, dict]:
    """Run ``h`` straight and as the killed lineage (two SIGKILLs, resumed each time)
    side by side, and assert S5: the final checkpoints hold bitwise-identical state and
    files, and the ledgers and manifests are byte-identical. Returns the straight run,
    the no-cursor control (resumed without its data cursor) and the straight run's
    manifest body."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        straight_f = pool.submit(straight_run, copy.copy(h))
        lineage_f = pool.submit(killed_lineage, copy.copy(h))
        straight, (killed, defective) = straight_f.result(), lineage_f.result()
    name_a, state_a, files_a = final_state(straight)
    name_b, state_b, files_b = final_state(killed)
    assert name_a == name_b == f"window-{windows:08d}"
    assert state_differences(state_a, state_b) == []
    assert files_a == files_b
    assert (straight / "ledger.jsonl").read_bytes() == (killed / "ledger.jsonl").read_bytes()
    assert (straight / "manifest.json").read_bytes() == (killed / "manifest.json").read_bytes()
    return straight, defective, json.loads((straight / "manifest.json").read_bytes())["manifest"]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_killed_and_resumed_family_run_is_bitwise_identical_s5(name, tmp_path):
    """One test per family (its four processes run once, whatever the test workers):
    straight = killed twice and resumed, bitwise; a resume without the data cursor
    differs (negative control)."""
    straight, defective, manifest = bitwise_lineage(FamilyHarness(tmp_path, FAMILIES[name]))
    state_a = final_state(straight)[1]
    assert manifest["config"]["objective"]["family"] == name
    check_draws_mattered(name, straight)
    differences = state_differences(state_a, final_state(defective)[1])
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
