"""S5 with a Hugging Face Llama, through the real command line (H1).

``exactstep train --set model.source=hf --set model.hf_config=<JSON>`` (random init,
the byte tokenizer, vocabulary 259) run straight, against the same run SIGKILLed
inside a window (after its update, before its ledger line) and again from outside
while a later window runs, resumed with ``exactstep resume`` each time: the final
checkpoint files are byte-identical, the ledgers and manifests are identical, and
the manifest records the ``hf_config`` table as given. Negative control: a resume
that drops the data cursor ends with different weights.

Every process runs through a small launcher (written into ``tmp_path``) that can
SIGKILL its own process at a named moment or apply the deliberate defect.
"""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from families.test_family_kill_resume import killed_lineage, lines, straight_run
from state.test_kill_resume import Harness

from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WINDOWS = 8
TABLE = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "tie_word_embeddings": True}


def hf_settings(corpus: Path) -> list[str]:
    pairs = {"seed": 3, "data.source": corpus, "data.val_fraction": 0.2,
             "batch.seq_len": 32, "batch.rows": 2, "model.source": "hf",
             "model.hf_config": json.dumps(TABLE), "update.accum": 2,
             "update.warmup": 2, "train.steps": WINDOWS, "train.eval_tokens": 64,
             "train.threads": 1, "train.device": "cpu", "checkpoint.every": 2,
             "checkpoint.keep": 2}
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


class HFHarness(Harness):
    """The kill-resume harness of ``state.test_kill_resume`` (its launcher kills at a
    window's end and injects the defects), training an HF Llama instead."""

    def train(self, run_dir: Path, **kw) -> int:
        return self.launch(["train", "--no-progress", "--out", str(run_dir),
                            *hf_settings(self.corpus)], run_dir=run_dir, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    h = HFHarness(tmp_path_factory.mktemp("hf_s5"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        straight = pool.submit(straight_run, copy.copy(h))  # same files, own last_output
        lineage = pool.submit(killed_lineage, copy.copy(h))
        return straight.result(), *lineage.result()


def final_state(run_dir: Path) -> tuple[str, dict, dict]:
    path = latest_checkpoint(run_dir / "checkpoints")
    model, parts = load_checkpoint(path)
    files = json.loads((path / "manifest.json").read_bytes())["files"]
    return path.name, {"model": model, **parts}, files


def test_hf_killed_and_resumed_run_is_bitwise_identical_s5(runs):
    straight, killed, _ = runs
    name_a, state_a, files_a = final_state(straight)
    name_b, state_b, files_b = final_state(killed)
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    assert any(k.startswith("hf.model.layers.") for k in state_a["model"])  # the HF model
    assert state_differences(state_a, state_b) == []
    assert files_a == files_b  # every checkpoint file hashes the same
    assert (straight / "ledger.jsonl").read_bytes() == (killed / "ledger.jsonl").read_bytes()
    assert lines(straight) == WINDOWS
    assert (straight / "manifest.json").read_bytes() == (killed / "manifest.json").read_bytes()
    manifest = json.loads((straight / "manifest.json").read_bytes())["manifest"]
    assert manifest["config"]["model"]["source"] == "hf"
    assert manifest["config"]["model"]["hf_config"] == TABLE


def test_hf_resume_without_cursor_fails_the_comparison_s5(runs):
    straight, _, defective = runs
    differences = state_differences(final_state(straight)[1], final_state(defective)[1])
    assert any(d.startswith("model.hf.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
