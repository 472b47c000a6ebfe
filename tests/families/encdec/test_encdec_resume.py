"""S5 for the encoder-decoder family through the real command line: ``exactstep train
--set objective.family=encdec`` (the built-in numwords pairs, nothing else chosen)
run straight, against the same run SIGKILLed inside a window (after its update,
before its ledger line) and resumed with ``exactstep resume``. The final checkpoints
hold bitwise-identical state and the ledgers and manifests are identical.

Negative control: the same comparison on a resume that drops the data cursor fails.
Reuses the launcher of ``test_kill_resume`` (which also advances every RNG stream
per window, so RNG restoration is observable).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from state.test_kill_resume import Harness, final_state, killed

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

SETTINGS = {
    "seed": 5,
    "objective.family": "encdec",
    "encdec.n_train": 60,
    "encdec.n_heldout": 4,
    "encdec.max_value": 99,
    "encdec.source_len": 12,
    "batch.seq_len": 40,
    "batch.rows": 2,
    "model.d_model": 16,
    "model.n_layers": 1,
    "model.n_heads": 2,
    "model.d_ff": 32,
    "encdec.max_new_tokens": 4,
    "update.accum": 2,
    "update.warmup": 2,
    "train.steps": 4,
    "train.eval_tokens": 64,
    "train.threads": 1,
    "train.device": "cpu",
    "checkpoint.every": 2,
    "checkpoint.keep": 2,
}


class EncDecHarness(Harness):
    def train(self, run_dir: Path, **kw) -> int:
        args = [arg for k, v in SETTINGS.items() for arg in ("--set", f"{k}={v}")]
        return self.launch(["train", "--no-progress", "--out", str(run_dir), *args],
                           run_dir=run_dir, **kw)


def train_killed_resumed_and_control(h: EncDecHarness) -> tuple[Path, Path, Path]:
    straight = h.root / "straight"
    assert h.train(straight) == 0, h.last_output
    run_dir = h.root / "killed"
    assert killed(h.train(run_dir, kill_at="window_end:2")), h.last_output
    control = h.root / "no_cursor"
    shutil.copytree(run_dir, control)
    assert h.resume(run_dir) == 0, h.last_output
    assert h.resume(control, defect="no_cursor") == 0, h.last_output
    return straight, run_dir, control


def test_a_killed_encdec_run_resumes_bitwise_and_a_cursorless_resume_does_not(tmp_path):
    """One test (not a module fixture shared by several), so a parallel test run
    starts these processes once."""
    straight, run_dir, control = train_killed_resumed_and_control(EncDecHarness(tmp_path))
    name_a, state_a = final_state(straight)
    name_b, state_b = final_state(run_dir)
    assert name_a == name_b == "window-00000004"
    assert state_differences(state_a, state_b) == []
    assert (straight / "ledger.jsonl").read_bytes() == (run_dir / "ledger.jsonl").read_bytes()
    assert (straight / "manifest.json").read_bytes() == (run_dir / "manifest.json").read_bytes()
    assert any(k.startswith("encoder.") for k in state_a["model"])  # the encoder-decoder
    # the run records the family and scores exact match
    manifest = json.loads((straight / "manifest.json").read_text())["manifest"]
    assert manifest["objective"]["family"] == "encoder_decoder"
    assert manifest["objective"]["decoder_input"] == "tgt[:-1]"
    assert manifest["data"]["source"] == "numwords" and manifest["data"]["kind"] == "pairs"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["exact_match_n"] == 4 and 0.0 <= summary["exact_match"] <= 1.0
    assert summary["exact_match_of"] == "held-out pairs"
    assert summary["heldout_tokens"] > 0
    # negative control: a resume without the data cursor ends elsewhere
    differences = state_differences(state_a, final_state(control)[1])
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
