"""``model.attn_implementation = "auto"`` (the default): exactstep's per-document
attention where the model allows it, else HF's backend with one line saying why (R3, X4).

* a Llama resolves to ``exactstep``, recorded in the adapter's manifest section, with
  no line; the same weights as every explicit backend;
* each feature ``exactstep`` refuses resolves to ``sdpa`` (``eager`` for a model
  without it) with one line naming the feature: attention logit soft-capping (Gemma 2),
  attention dropout, a sliding window shorter than ``batch.seq_len`` (Mistral), sinks
  (gpt-oss), a model outside transformers' attention interface (GPT-Neo). Negative
  controls: the same config without the feature (or rows within the window) resolves
  to ``exactstep``; an explicit backend is never changed (an explicit ``exactstep``
  with the feature is still the refusal);
* through the command line: the config records ``auto`` as given, the manifest's
  model section the resolved backend; a fallback prints its line once on train and
  once on resume, which goes through (the resolution is a function of the config);
  negative control: a Llama prints none.

Models from configs only (no download).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from hf_support import COMMON, hf_config  # noqa: E402
from run_support import TINY, set_args  # noqa: E402
from text_corpus import write_corpus  # noqa: E402

from exactstep.cli import main  # noqa: E402
from exactstep.errors import ModelError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402

VOCAB = 64
SEQ_LEN = 18
NOTE = "model.attn_implementation = 'auto' runs "

GEMMA2 = {"model_type": "gemma2", **COMMON, "head_dim": 8, "final_logit_softcapping": None}
GPT_OSS = {"model_type": "gpt_oss", **COMMON, "head_dim": 8, "num_local_experts": 2,
           "num_experts_per_tok": 1}
GPT_NEO = {"model_type": "gpt_neo", "hidden_size": 32, "num_layers": 2, "num_heads": 4,
           "attention_types": [[["global"], 2]], "max_position_embeddings": 64}


def build(table: dict, attn: str | None = None, seq_len: int | None = SEQ_LEN):
    extra = {} if attn is None else {"attn_implementation": attn}
    return build_model(ModelConfig(source="hf", hf_config=table, **extra), VOCAB, seed=0,
                       seq_len=seq_len)


def test_the_default_is_auto_and_a_llama_runs_exactstep_with_no_line():
    assert ModelConfig().attn_implementation == "auto"
    model = build(hf_config("llama"))
    assert model.attn_implementation == "exactstep" == model.hf.config._attn_implementation
    assert model.describe()["attn_implementation"] == "exactstep"
    assert model.backend_note is None
    # the backend holds no parameter: the same initial weights under each
    assert {build(hf_config("llama"), attn).initial_weights_sha256
            for attn in ("sdpa", "exactstep")} == {model.initial_weights_sha256}


@pytest.mark.parametrize("table, seq_len, fallback, said, control", [
    (GEMMA2, SEQ_LEN, "eager", "attention logit soft-capping (attn_logit_softcapping = 50.0)",
     ({**GEMMA2, "attn_logit_softcapping": None}, SEQ_LEN)),
    ({**hf_config("llama"), "attention_dropout": 0.1}, SEQ_LEN, "sdpa",
     "attention dropout (attention_dropout = 0.1)",
     ({**hf_config("llama"), "attention_dropout": 0.0}, SEQ_LEN)),
    ({**hf_config("mistral"), "sliding_window": 8}, SEQ_LEN, "sdpa",
     "sliding_window = 8 (sliding attention), shorter than batch.seq_len = 18",
     ({**hf_config("mistral"), "sliding_window": 8}, 8)),  # rows within the window
    ({**hf_config("mistral"), "sliding_window": 8}, None, "sdpa",
     "sliding_window = 8 (sliding attention), shorter than max_position_embeddings = 64",
     ({**hf_config("mistral"), "sliding_window": 64}, None)),  # no row can pass it
    (GPT_OSS, SEQ_LEN, "eager", "attention sinks", None),
    (GPT_NEO, SEQ_LEN, "eager", "runs its own attention (GPTNeoForCausalLM), outside "
     "transformers' attention interface", None),
], ids=["soft-capping", "attention-dropout", "window", "window-without-seq-len", "sinks",
        "outside-the-interface"])
def test_a_refused_feature_falls_back_with_one_line(table, seq_len, fallback, said, control):
    model = build(table, seq_len=seq_len)
    assert model.attn_implementation == fallback == model.hf.config._attn_implementation
    assert model.describe()["attn_implementation"] == fallback
    note = model.backend_note
    assert note.startswith(f"{NOTE}'{fallback}': the {table['model_type']} model ")
    assert said in note and "'exactstep' (per-document attention)" in note
    assert "\n" not in note
    if control is not None:  # negative control: without the feature, exactstep
        plain = build(*control[:1], seq_len=control[1])
        assert plain.attn_implementation == "exactstep" and plain.backend_note is None


def test_an_explicit_backend_is_never_resolved():
    """``auto`` alone falls back: an explicit ``exactstep`` with attention dropout is
    still the refusal, an explicit ``sdpa`` on a Llama stays ``sdpa``."""
    with pytest.raises(ModelError, match="attention dropout.*attn_implementation = 'sdpa'"):
        build({**hf_config("llama"), "attention_dropout": 0.1}, "exactstep")
    model = build(hf_config("llama"), "sdpa")
    assert model.attn_implementation == "sdpa" and model.backend_note is None


def hf_run(tmp_path, table: dict, name: str) -> list[str]:
    corpus = tmp_path / "docs.jsonl"
    write_corpus(corpus)
    rows = {k: v for k, v in TINY.items() if not k.startswith("model.")}
    return ["train", "--out", str(tmp_path / name), "--no-progress",
            *set_args({**rows, "data.source": corpus, "model.source": "hf",
                       "model.hf_config": json.dumps(table), "train.steps": 1,
                       "update.warmup": 0, "train.eval_tokens": 32, "train.threads": 1})]


def manifest_of(run) -> dict:
    return json.loads((run / "manifest.json").read_text())["manifest"]


def notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if NOTE in line]


@pytest.mark.slow
def test_a_run_records_auto_and_the_resolved_backend_and_says_a_fallback_once(tmp_path, capfd):
    table = {**hf_config("llama", vocab_size=259), "attention_dropout": 0.1}
    assert main(hf_run(tmp_path, table, "dropout")) == 0
    said = notes(capfd.readouterr().err)
    assert said == [f"exactstep: {NOTE}'sdpa': the llama model applies attention dropout "
                    "(attention_dropout = 0.1), which 'exactstep' (per-document attention) "
                    "does not"]
    manifest = manifest_of(tmp_path / "dropout")
    assert manifest["config"]["model"]["attn_implementation"] == "auto"  # as given
    assert manifest["model"]["attn_implementation"] == "sdpa"  # as resolved
    # the same resolution on resume: the same manifest, so the resume is accepted
    assert main(["resume", str(tmp_path / "dropout"), "--no-progress"]) == 0
    assert notes(capfd.readouterr().err) == said
    # negative control: a Llama without dropout runs exactstep and says nothing
    assert main(hf_run(tmp_path, hf_config("llama", vocab_size=259), "plain")) == 0
    assert notes(capfd.readouterr().err) == []
    assert manifest_of(tmp_path / "plain")["model"]["attn_implementation"] == "exactstep"
