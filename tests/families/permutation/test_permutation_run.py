"""``exactstep train --set objective.family=permutation`` end to end (R8, S1, S5).

A tiny run on the built-in text (the family's default source) trains, records the
family's objective section in its manifest, and reports held-out figures on the
predicted tokens next to the unigram baseline on the same targets. Resumed from its
middle checkpoint it ends bitwise where the uninterrupted run ended (weights,
optimizer, RNG streams, data cursor, ledger). Negative control: a compiler whose
orders come from one stream per process (not addressed by the piece) parts the two.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from run_support import TINY, set_args

from exactstep.cli import main
from exactstep.families.permutation import compiler as perm
from exactstep.state import latest_checkpoint, load_checkpoint
from exactstep.state.compare import state_differences

pytestmark = pytest.mark.timeout(240)

SETTINGS = {"objective.family": "permutation", **TINY, "data.max_docs": 24,
            "data.val_fraction": 0.25, "train.steps": 4, "checkpoint.every": 2,
            "checkpoint.keep": 5, "train.eval_tokens": 256, "update.warmup": 1,
            "train.threads": 1, "permutation.predict_one_in": 3}


def straight_and_resumed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    straight, copy = tmp_path / f"{name}-straight", tmp_path / f"{name}-resumed"
    assert main(["train", "--out", str(straight), "--no-progress", *set_args(SETTINGS)]) == 0
    shutil.copytree(straight, copy)
    middle = copy / "checkpoints" / "window-00000002"
    assert main(["resume", str(copy), "--from", str(middle), "--no-progress"]) == 0
    return straight, copy


def differences(straight: Path, resumed: Path) -> list[str]:
    a = load_checkpoint(latest_checkpoint(straight / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(resumed / "checkpoints"))
    out = state_differences(a, b)
    if (straight / "ledger.jsonl").read_bytes() != (resumed / "ledger.jsonl").read_bytes():
        out.append("ledger.jsonl")
    return out


@pytest.mark.slow
def test_a_permutation_run_records_its_objective_and_resumes_bitwise(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, "addressed")
    assert differences(straight, resumed) == []

    manifest = json.loads((straight / "manifest.json").read_text())["manifest"]
    objective = manifest["objective"]
    assert objective["family"] == "permutation_lm" and objective["predict_one_in"] == 3
    assert objective["memory"] == "none" and "0x7065726d" in objective["order_rng"]
    assert manifest["config"]["objective"]["family"] == "permutation"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["heldout_tokens"] > 0 and summary["unigram_bits_per_token"] > 0
    real = summary["data"]["real_tokens"]
    # about a third of the tokens are predicted (K = 3), never more than every free one
    assert 0.25 * real < summary["data"]["supervised_rows"] <= real
    assert main(["eval", str(straight)]) == 0


def test_negative_control_orders_from_one_process_stream_break_the_resume(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    monkeypatch.setattr(perm, "draw_order",
                        lambda n, **address: rng.permutation(n).astype(np.int64))
    straight, resumed = straight_and_resumed(tmp_path, "stream")
    assert differences(straight, resumed) != []


def test_inspect_shows_the_factorisation_order(capsys):
    argv = ["inspect", "--rows", "0:1", *set_args({k: v for k, v in SETTINGS.items()
                                                   if not k.startswith("train.")})]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "order (columns)" in out and "rank" in out
