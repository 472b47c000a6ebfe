"""S5 with ``model.activation_checkpointing = true`` (H5), through the real command line.

The built-in decoder, and an HF Llama with attention dropout (the recompute replays
masks drawn from the RNG that a resume restores), each run straight against the same
run SIGKILLed inside a window and again from outside, resumed each time: the final
checkpoint files, ledgers and manifests are byte-identical, and the manifest records
the flag. Negative control: a resume that drops the data cursor ends elsewhere.

Uses the launcher of ``state.test_kill_resume`` and the lineage of
``families.test_family_kill_resume``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families.test_family_kill_resume import bitwise_lineage, final_state
from state.test_hf_kill_resume import TABLE, hf_settings
from state.test_kill_resume import WINDOWS, Harness, settings

from exactstep.state.compare import state_differences

pytestmark = pytest.mark.slow

HF_WINDOWS = 8  # the HF settings' run length (state.test_hf_kill_resume.WINDOWS)
DROPOUT_TABLE = {**TABLE, "attention_dropout": 0.2}

RUNS = {
    "builtin": (lambda corpus: settings(corpus), {}, WINDOWS),
    "hf_dropout": (lambda corpus: hf_settings(corpus),
                   {"model.hf_config": json.dumps(DROPOUT_TABLE)}, HF_WINDOWS),
}


class CheckpointingHarness(Harness):
    """The tiny run of ``name`` with ``model.activation_checkpointing = true``."""

    def __init__(self, root: Path, name: str) -> None:
        super().__init__(root)
        self.name = name

    def train(self, run_dir: Path, **kw) -> int:
        base, extra, _ = RUNS[self.name]
        pairs = {**extra, "model.activation_checkpointing": "true"}
        more = [arg for k, v in pairs.items() for arg in ("--set", f"{k}={v}")]
        return self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *base(self.corpus), *more], run_dir=run_dir, **kw)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_killed_and_resumed_checkpointed_run_is_bitwise_identical_s5_h5(name, tmp_path):
    straight, defective, manifest = bitwise_lineage(CheckpointingHarness(tmp_path, name),
                                                    windows=RUNS[name][2])
    state_a = final_state(straight)[1]
    assert manifest["config"]["model"]["activation_checkpointing"] is True
    if name == "hf_dropout":
        assert manifest["config"]["model"]["hf_config"]["attention_dropout"] == 0.2
    differences = state_differences(state_a, final_state(defective)[1])
    assert any(d.startswith("model.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
