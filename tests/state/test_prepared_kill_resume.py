"""S5 and P2 through the real command line: a run trained from prepared shards
(``data.source = DIR``) run straight, against the same run SIGKILLed inside a window
(after its update, before its ledger line) and from outside while a later window
runs, resumed with ``exactstep resume`` each time. The final checkpoints hold
bitwise-identical state, the ledgers and manifests are identical, and the data
cursor in the checkpoint is the prepared stream's (epoch, position, pending pieces).

Negative control: a resume that drops the data cursor ends with other weights.

It reuses the launcher and helpers of ``test_kill_resume``; only the data source
differs (a directory prepared once from the same 48-document corpus).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from state.test_kill_resume import Harness, final_state, killed, ledger_lines, run_straight

from exactstep.artifacts.prepare import prepare
from exactstep.config import load_config
from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow


class PreparedHarness(Harness):
    """``Harness`` whose runs read ``root/prepared`` (prepared once, before any run)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.corpus = root / "prepared"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared-s5")
    h = PreparedHarness(root)
    prepare(load_config(None, ["data.val_fraction=0.2"]), str(root / "corpus.jsonl"),
            h.corpus, shard_tokens=256, block_documents=8, progress=False)
    straight = run_straight(h)
    run_dir = root / "killed"
    assert killed(h.train(run_dir, kill_at="window_end:3")), h.last_output
    control = root / "no_cursor"
    shutil.copytree(run_dir, control)
    assert killed(h.resume(run_dir, kill_after_lines=ledger_lines(run_dir) + 2)), h.last_output
    assert h.resume(run_dir) == 0, h.last_output
    assert h.resume(control, defect="no_cursor") == 0, h.last_output
    return straight, run_dir, control


def test_a_killed_run_from_prepared_shards_resumes_bitwise(runs) -> None:
    straight, run_dir, _ = runs
    name_a, state_a = final_state(straight)
    name_b, state_b = final_state(run_dir)
    assert name_a == name_b
    assert state_differences(state_a, state_b) == []
    assert (straight / "ledger.jsonl").read_bytes() == (run_dir / "ledger.jsonl").read_bytes()
    assert (straight / "manifest.json").read_bytes() == (run_dir / "manifest.json").read_bytes()
    planner = state_a["data"]["planner"]
    assert {"epoch", "cursor", "pending"} <= set(planner)
    assert planner["settings"]["examples"] < 48  # the prepared train split, not a list


def test_the_manifest_records_the_prepared_data(runs) -> None:
    import json

    straight, _, _ = runs
    data = json.loads((straight / "manifest.json").read_text())["manifest"]["data"]
    assert data["format"] == "prepared"
    assert data["order"]["rule"] == "block-permutation"
    prepared = json.loads((straight.parent / "prepared" / "prepared.json").read_text())
    assert data["fingerprint"] == prepared["fingerprint"]


def test_a_resume_without_the_cursor_fails_the_comparison(runs) -> None:
    straight, _, control = runs
    _, state_a = final_state(straight)
    _, state_b = final_state(control)
    differences = state_differences(state_a, state_b)
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
