"""Hugging Face architectures at the adapter's edges (H1, R3).

* the decoder stack: ``Llama4ForCausalLM`` and ``MllamaForCausalLM`` name a
  ``base_model_prefix`` they do not have, so ``base_model`` (and ``get_decoder()``)
  is the whole CausalLM; the adapter finds the stack that returns hidden states
  before the head, and their packed rows equal their documents alone (in
  test_hf_packed through ``FAMILIES``); a CausalLM whose stack cannot be found, or
  whose stack returns no ``last_hidden_state``, is one ``ModelError`` naming its
  class (one ``error:`` line from the CLI), never an ``AttributeError``.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import transformers  # noqa: E402
from hf_support import hf_config, hf_model  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from text_corpus import write_corpus  # noqa: E402

import exactstep.model.hf as hf  # noqa: E402
from exactstep.cli import main  # noqa: E402
from exactstep.errors import ConfigError, ModelError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402

VOCAB = 64


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
