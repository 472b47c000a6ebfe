"""R8, Q5, S1: the ``professor`` family through the command line and ``inspect``.

A tiny run on the built-in arithmetic chats: the manifest names every part of the
procedure the reference article lists (paths, behaviour and its masks, discriminator,
coefficients, order, optimizers, rollout policy); every ledger line holds the
discriminator's loss beside the generator's; the rollout journal has one line per
example; the checkpoint holds the discriminator's weights, moments and clock.
``inspect`` shows one example's two paths and both rows.
"""

from __future__ import annotations

import json

import pytest

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.families.inspect import inspect_rows
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.state.store import latest_checkpoint

SETTINGS = {"objective.family": "professor", "data.source": "arith", "data.kind": "chat",
            "arith.n_train": 32, "arith.n_heldout": 4, "arith.max_new_tokens": 4,
            "batch.seq_len": 112, "batch.rows": 2, "generation.max_new_tokens": 4,
            "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
            "professor.d_hidden": 8, "train.steps": 3, "train.eval_tokens": 64,
            "train.threads": 1, "update.warmup": 1}
PARTS = {"paths", "behaviour", "discriminator", "generator", "order", "transaction", "over"}


def args(**extra) -> list[str]:
    return [a for k, v in {**SETTINGS, **extra}.items() for a in ("--set", f"{k}={v}")]


def test_a_run_declares_the_procedure_and_logs_both_losses(tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--no-progress", *args()]) == 0
    manifest = json.loads((run / "manifest.json").read_bytes())["manifest"]
    objective = manifest["objective"]
    assert objective["family"] == "professor_chat_sft"  # over the chat family
    assert set(objective["professor"]) == PARTS
    assert objective["professor"]["generator"]["lambda_free"] == 1.0
    assert objective["professor"]["order"] == {
        "name": "d_then_g", "d_steps": 1,
        "generator_sees": "the discriminator after its d_steps steps",
        "discriminator_sees": "the generator at the window's start"}
    assert objective["generation"]["samples"] == 1
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert [r["disposition"] for r in ledger] == ["COMMITTED"] * 3
    for r in ledger:
        d = r["inputs"]["discriminator"]
        assert len(d["loss"]) == 1 and d["loss"][0] > 0 and d["committed"] is True
        assert r["inputs"]["generator_adversarial"] > 0 and r["gold_nll"] > 0
        assert r["D"] == r["inputs"]["examples"]  # D: the window's examples
    journal = (run / "rollouts.jsonl").read_text().splitlines()
    assert len(journal) == sum(r["inputs"]["examples"] for r in ledger)
    _, parts = load_checkpoint(latest_checkpoint(run / "checkpoints"))
    disc = parts["program"]["discriminator"]
    assert disc["committed"] == 3 and disc["schedule"]["updates"] == 3
    assert float(disc["optimizer"]["state"][0]["step"]) == 3.0


def test_inspect_shows_both_paths_of_an_example():
    cfg = load_config(None, [f"{k}={v}" for k, v in SETTINGS.items()])
    text = inspect_rows(cfg, range(0, 1))
    lines = text.splitlines()
    assert lines[0].startswith("window 0: ") and "teacher-forced row and a free-running" \
        in lines[0]
    assert lines[1].startswith("example ") and "prompt '" in lines[1]
    assert lines[2].lstrip().startswith("teacher-forced: ") and "P(teacher-forced)" in lines[2]
    assert lines[3].lstrip().startswith("free-running: ") and "drawn" in lines[3]
    assert text.count("row 0:") == 1 and sum(x.startswith("row ") for x in lines) == 2
    with pytest.raises(ConfigError, match="examples"):
        inspect_rows(cfg, range(0, 99))
