"""S5 under ``numerics.precision = "bf16"`` with an HF Llama loaded from a bf16 checkpoint.

The run of ``state.test_hf_kill_resume`` (through the real command line), but from a
``model.path`` whose weights ``save_pretrained`` wrote in bf16 and with bf16 autocast
around the forward and the loss (U2, H1): straight, against the same run SIGKILLed
inside a window and again from outside, resumed each time, the final checkpoint files,
ledgers and manifests are byte-identical; the checkpoint holds fp32 weights (the
master weights, ``model.dtype``) and the manifest records the precision and the stored
dtype. Negative control: a resume that drops the data cursor ends elsewhere.
"""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from families.test_family_kill_resume import killed_lineage, lines, straight_run
from state.test_hf_kill_resume import TABLE, WINDOWS, final_state, hf_settings
from state.test_kill_resume import Harness

from exactstep.state.compare import state_differences

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

import torch  # noqa: E402


def bf16_checkpoint(directory: Path) -> Path:
    table = {**TABLE, "vocab_size": 259}
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


class Bf16Harness(Harness):
    """``state.test_hf_kill_resume``'s run from a bf16 ``model.path``, in bf16."""

    model_dir: Path

    def train(self, run_dir: Path, **kw) -> int:
        args = hf_settings(self.corpus)
        at = args.index(f"model.hf_config={json.dumps(TABLE)}")
        args[at] = f"model.path={self.model_dir}"
        args += ["--set", "numerics.precision=bf16"]
        return self.launch(["train", "--no-progress", "--out", str(run_dir), *args],
                           run_dir=run_dir, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    h = Bf16Harness(tmp_path_factory.mktemp("hf_bf16_s5"))
    h.model_dir = bf16_checkpoint(h.root / "llama_bf16")
    with ThreadPoolExecutor(max_workers=2) as pool:
        straight = pool.submit(straight_run, copy.copy(h))
        lineage = pool.submit(killed_lineage, copy.copy(h))
        return straight.result(), *lineage.result()


def test_bf16_hf_killed_and_resumed_run_is_bitwise_identical_s5_u2(runs):
    straight, killed, _ = runs
    name_a, state_a, files_a = final_state(straight)
    name_b, state_b, files_b = final_state(killed)
    assert name_a == name_b == f"window-{WINDOWS:08d}"
    weights = {k: v for k, v in state_a["model"].items() if k.startswith("hf.model.layers.")}
    assert weights and all(v.dtype == torch.float32 for v in weights.values())
    assert state_differences(state_a, state_b) == []
    assert files_a == files_b
    assert (straight / "ledger.jsonl").read_bytes() == (killed / "ledger.jsonl").read_bytes()
    assert lines(straight) == WINDOWS
    assert (straight / "manifest.json").read_bytes() == (killed / "manifest.json").read_bytes()
    manifest = json.loads((straight / "manifest.json").read_bytes())["manifest"]
    assert manifest["numerics"]["precision"] == "bf16"
    assert manifest["model"]["stored_dtype"] == "bfloat16"


def test_bf16_hf_resume_without_cursor_fails_the_comparison_s5(runs):
    straight, _, defective = runs
    differences = state_differences(final_state(straight)[1], final_state(defective)[1])
    assert any(d.startswith("model.hf.") for d in differences)
    assert any(d.startswith("data.") for d in differences)
