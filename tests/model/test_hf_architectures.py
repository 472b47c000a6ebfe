"""Hugging Face architectures at the adapter's edges (H1, R1, R3, L3).

* the decoder stack: ``Llama4ForCausalLM`` and ``MllamaForCausalLM`` name a
  ``base_model_prefix`` they do not have, so ``base_model`` (and ``get_decoder()``)
  is the whole CausalLM; the adapter finds the stack that returns hidden states
  before the head, and their packed rows equal their documents alone (in
  test_hf_packed through ``FAMILIES``); a CausalLM whose stack cannot be found, or
  whose stack returns no ``last_hidden_state``, is one ``ModelError`` naming its
  class (one ``error:`` line from the CLI), never an ``AttributeError``;
* MoE router logits (``output_router_logits``): the load-balancing loss HF adds to
  its own loss would be dropped, so it is refused naming the key and the fix; off,
  the same model builds and trains;
* a model without ``sdpa``: the refusal names ``model.attn_implementation = 'eager'``
  (and a backend that cannot isolate suggests ``eager``, not ``sdpa``, for it); the
  eager model builds.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402
from equivalence import equivalence_error  # noqa: E402
from hf_equivalence import run_packed, run_separately  # noqa: E402
from hf_support import COMMON, hf_config, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from text_corpus import write_corpus  # noqa: E402

import exactstep.model.hf as hf  # noqa: E402
from exactstep.cli import main  # noqa: E402
from exactstep.errors import ConfigError, ModelError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402

VOCAB = 64
#: R3 (fp32). No float64 yardstick here: the MoE experts' grouped matmul runs in fp32,
#: bf16 or fp16 only; O(1) logits and gradients of this 2-layer d=32 model round to
#: ~1e-7, two orders below
TOL = 1e-5
SEQ_LEN = 12


def build(table: dict, attn: str = "sdpa"):
    return build_model(ModelConfig(source="hf", hf_config=table, attn_implementation=attn),
                       VOCAB, seed=0)


# ------------------------------------------------------------------ the decoder stack


@pytest.mark.parametrize("family, causal_lm", [("llama4", "Llama4ForCausalLM"),
                                               ("mllama", "MllamaForCausalLM")])
def test_the_decoder_stack_is_found_where_base_model_is_the_whole_model(family, causal_lm):
    model = hf_model(family, VOCAB)
    assert type(model.hf).__name__ == causal_lm
    assert model.hf.base_model is model.hf  # what made the run end in an AttributeError
    assert model.decoder is model.hf.model and model.decoder_name == "model"
    hidden = model(packed_batch(fill_rows([[5, 4], [7]], VOCAB), 10))
    assert hidden.shape == (2, 10, 32)  # [B, T, H]
    assert all(not name.startswith("decoder") for name in model.state_dict())  # not twice
    assert model.vocab_size == VOCAB  # Mllama: the tokenizer's size reached its text_config


def test_a_nested_text_config_key_is_checked_for_typos():
    table = hf_config("mllama")
    table["text_config"] = {**table["text_config"], "hiden_size": 32}
    with pytest.raises(ConfigError, match="model.hf_config.text_config.hiden_size is not a key"):
        build(table)


def test_a_causal_lm_whose_stack_cannot_be_found_is_one_model_error(monkeypatch):
    """Negative control of the lookup: without the conventional attribute names,
    Llama 4's stack is not found, and that is a ModelError naming the class."""
    monkeypatch.setattr(hf, "DECODER_ATTRIBUTES", ())
    with pytest.raises(ModelError) as info:
        hf_model("llama4", VOCAB)
    message = str(info.value)
    assert "Llama4ForCausalLM" in message and "last_hidden_state" in message
    assert "base_model" in message  # what the user can do: a model whose base_model is it


def test_a_stack_that_returns_no_hidden_states_is_one_model_error(monkeypatch):
    monkeypatch.setattr(transformers.LlamaModel, "forward", lambda self, **kw: (None,))
    with pytest.raises(ModelError, match="LlamaForCausalLM.*returns no last_hidden_state"):
        hf_model("llama", VOCAB)


def test_the_cli_prints_one_error_line_for_a_stack_it_cannot_find(monkeypatch, tmp_path, capfd):
    monkeypatch.setattr(hf, "DECODER_ATTRIBUTES", ())
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    table = json.dumps({**hf_config("llama4"), "vocab_size": 259})
    capfd.readouterr()
    code = main(["train", "--out", str(tmp_path / "out"), "--no-progress",
                 "--set", f"data.source={corpus}", "--set", "batch.seq_len=16",
                 "--set", "train.steps=1", "--set", "train.device=cpu",
                 "--set", "train.threads=1", "--set", "model.source=hf",
                 "--set", f"model.hf_config={table}"])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Llama4ForCausalLM" in lines[0] and "Traceback" not in out + err


# ------------------------------------------------------------------ MoE router logits

MOE = {
    "mixtral": {"model_type": "mixtral", **COMMON, "num_local_experts": 2,
                "num_experts_per_tok": 1},
    "qwen2_moe": {"model_type": "qwen2_moe", **COMMON, "num_experts": 2,
                  "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "llama4": hf_config("llama4"),
}


@pytest.mark.parametrize("family", sorted(MOE))
def test_router_logits_on_are_refused_naming_the_key_off_trains(family):
    with pytest.raises(ModelError) as info:
        build({**MOE[family], "output_router_logits": True})
    message = str(info.value)
    assert "model.hf_config.output_router_logits" in message and "false" in message
    assert "load-balancing" in message and len(message.splitlines()) == 1
    # negative control: the same model with router logits off builds and trains exactly
    model = build({**MOE[family], "output_router_logits": False})
    model.train()
    rows = fill_rows([[4, 5], [8]], VOCAB, seed=1)
    assert equivalence_error(run_packed(model, rows, SEQ_LEN), run_separately(model, rows)) <= TOL


def test_router_logits_in_a_saved_config_name_its_file(tmp_path):
    table = dict(MOE["mixtral"], vocab_size=VOCAB, output_router_logits=True)
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ModelError) as info:
        build_model(ModelConfig(source="hf", path=str(tmp_path)), VOCAB, seed=0)
    assert "output_router_logits" in str(info.value)
    assert str(tmp_path / "config.json") in str(info.value)


# ------------------------------------------------------------------ a model without sdpa

GEMMA2 = {"model_type": "gemma2", **COMMON, "head_dim": 8, "final_logit_softcapping": None}


def test_a_model_without_sdpa_is_refused_naming_eager():
    with pytest.raises(ModelError) as info:
        build(GEMMA2, "sdpa")
    message = str(info.value)
    assert "model.attn_implementation = 'eager'" in message and "gemma2" in message
    assert len(message.splitlines()) == 1
    # negative control: eager, the backend the message names, builds (its probe passes)
    assert build(GEMMA2, "eager").attn_implementation == "eager"


def test_a_backend_that_cannot_isolate_suggests_eager_where_sdpa_is_missing():
    with pytest.raises(ModelError) as info:
        build(GEMMA2, "flash_attention_2")
    assert "model.attn_implementation = 'eager'" in str(info.value)
    with pytest.raises(ModelError) as info:  # negative control: llama has sdpa
        build(hf_config("llama"), "flash_attention_2")
    assert "model.attn_implementation = 'sdpa'" in str(info.value)
