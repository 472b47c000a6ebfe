"""The README's real-shaped LoRA demo (``configs/qwen2_0p5b_lora.toml``; H1, H4, H5, L1).

The configuration holds Qwen2.5-0.5B's ``config.json`` values (written out here from
the published file, the independent side) and trains LoRA adapters with activation
checkpointing. The command the README gives for a downloaded checkpoint (the same
file, ``model.hf_config={}``, ``model.path``, the checkpoint's tokenizer and chat
template, a chat JSONL) is run as written on a tiny Qwen2 saved to disk.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import process_server
import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from exactstep.config import load_config  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "src/exactstep/configs/qwen2_0p5b_lora.toml"
#: Qwen2.5-0.5B's config.json, the keys the demo copies
QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
              "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "max_position_embeddings": 32768, "max_window_layers": 24, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "sliding_window": 32768, "use_sliding_window": False,
              "tie_word_embeddings": True, "initializer_range": 0.02, "hidden_act": "silu",
              "attention_dropout": 0.0, "vocab_size": 151936}


def test_the_demo_holds_qwen25_05b_shape_with_lora_and_checkpointing():
    cfg = load_config(CONFIG)
    assert cfg.model.source == "hf" and cfg.model.hf_config == QWEN25_05B
    assert cfg.model.lora.enabled and cfg.model.lora.r == 16
    assert cfg.model.activation_checkpointing


@pytest.mark.slow
def test_the_readme_command_for_a_downloaded_checkpoint_runs(tmp_path):
    """``--set model.hf_config={} model.path=DIR data.tokenizer=hf data.source=...``
    on the demo's file: the model, tokenizer and chat template come from DIR; only the
    adapters train and the checkpoint holds them alone."""
    from tokenizer_support import CHATML_MARKED, save_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir = save_tokenizer(tmp_path / "qwen", chat_template=CHATML_MARKED,
                               eos="<|im_end|>")
    config = Qwen2Config(vocab_size=416, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_window_layers=2, tie_word_embeddings=True)
    Qwen2ForCausalLM(config).save_pretrained(str(model_dir))
    chats = tmp_path / "chats.jsonl"
    with chats.open("w", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"What is {i} + {i}?"},
                {"role": "assistant", "content": f"{2 * i}, of course."}]}) + "\n")
    run = tmp_path / "run"
    command = [sys.executable, "-m", "exactstep", "train", "--config", str(CONFIG),
               "--out", str(run), "--no-progress",
               "--set", "model.hf_config={}", "--set", f"model.path={model_dir}",
               "--set", "data.tokenizer=hf", "--set", f"data.source={chats}",
               # tiny, for the test
               "--set", "data.val_fraction=0.2", "--set", "batch.seq_len=64",
               "--set", "batch.rows=2", "--set", "train.steps=2", "--set",
               "train.eval_tokens=64"]
    done = process_server.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["manifest"]["model"]["lora"]["base_weights_sha256"]
    from safetensors import safe_open

    latest = (run / "checkpoints" / "LATEST").read_text().strip()
    with safe_open(str(run / "checkpoints" / latest / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all("lora_" in n for n in names)
