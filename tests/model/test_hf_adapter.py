"""The Hugging Face adapter's interface and refusals (H1, R1, R3, U6, S5, L1).

* interface: hidden states from the base model (never logits, never ``labels=``),
  the head as ``[V, H]``, a tied embedding/head one Parameter in the optimizer
  groups (U6);
* random init deterministic in the seed, global RNG streams untouched (S5);
* a ``save_pretrained`` directory loads with its exact weights; missing files and
  missing weights are refused naming the path;
* refusals before the first step, each a ``ModelError`` naming the feature: a
  backend that cannot isolate segments, an architecture the build-time probe sees
  leaking (a real one: Jamba's recurrent layer; and the adapter's own mask
  withheld), a head that is not a plain linear map (named features, and the probe
  without the names), a vocabulary smaller than the tokenizer's, rows longer than
  the positions or a sliding window the adapter does not realise.
"""

from __future__ import annotations

import copy
import dataclasses
import random

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import transformers  # noqa: E402
from equivalence import gamma, spread_bound  # noqa: E402
from hf_support import hf_config, hf_model, hf_model_config  # noqa: E402
from model_batches import fill_rows, packed_batch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import exactstep.model.hf as hf  # noqa: E402
from exactstep.errors import ConfigError, ModelError  # noqa: E402
from exactstep.model.config import ModelConfig  # noqa: E402
from exactstep.model.decoder import build_model  # noqa: E402
from exactstep.update.config import UpdateConfig  # noqa: E402
from exactstep.update.groups import resolve_groups  # noqa: E402

VOCAB = 64
PROBE_BATCH = hf.probe_batch


def batch():
    return packed_batch(fill_rows([[5, 4], [7]], VOCAB, seed=2), 10)


def rng_streams():
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone()


def same_streams(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


# ----------------------------------------------------------------------- interface


def test_forward_returns_final_hidden_states_and_never_calls_the_lm_head_r1(monkeypatch):
    model = hf_model("llama", VOCAB)
    calls = []
    monkeypatch.setattr(model.hf, "forward", lambda *a, **k: calls.append(k) or 1 / 0)
    b = batch()
    norm = model.hf.model.norm
    inputs = []
    hook = norm.register_forward_hook(lambda mod, args, out: inputs.append(args[0].detach()))
    hidden = model(b)
    hook.remove()
    assert hidden.shape == (2, 10, 32) and calls == []  # [B, T, H]; the CausalLM never runs
    # the final norm is applied: RMSNorm with unit gain gives rows of RMS exactly
    # sqrt(ms / (ms + eps)) for an input of mean square ms; fp32 rounds the mean square
    # (32 terms), the epsilon, the reciprocal root and the product: gamma(2H) relatively
    (x,) = inputs
    ms = x.double().pow(2).mean(-1)
    expected = (ms / (ms + norm.variance_epsilon)).sqrt()
    rms = hidden.double().pow(2).mean(-1).sqrt()
    assert ((rms - expected).abs() <= gamma(2 * 32) * expected).all()
    assert model.logits(hidden).shape == (2, 10, VOCAB)


def test_tied_head_is_one_parameter_in_the_groups_u6():
    tied = hf_model("llama", VOCAB, tie_word_embeddings=True)
    untied = hf_model("llama", VOCAB, tie_word_embeddings=False)
    assert tied.head_weight is tied.hf.get_input_embeddings().weight
    rows = resolve_groups(tied, UpdateConfig()).table
    embedding = [r for r in rows if r["name"] == "hf.model.embed_tokens.weight"]
    assert len(embedding) == 1 and embedding[0]["aliases"] == ["hf.lm_head.weight"]
    assert all(r["name"] != "hf.lm_head.weight" for r in rows)
    # counted once: the untied model has exactly one more [V, H] matrix
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * 32
    assert tied.num_parameters() == sum(r["numel"] for r in rows)
    assert sum(r["numel"] for r in resolve_groups(untied, UpdateConfig()).table) == (
        untied.num_parameters())


def test_random_init_is_deterministic_in_the_seed_and_leaves_global_rng_alone_s5():
    before = rng_streams()
    a = hf_model("qwen2", VOCAB, seed=7).state_dict()
    after = rng_streams()
    b = hf_model("qwen2", VOCAB, seed=7).state_dict()
    c = hf_model("qwen2", VOCAB, seed=8).state_dict()
    assert same_streams(before, after)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)  # negative control: the seed matters


def test_missing_hf_config_vocab_size_takes_the_tokenizers():
    assert hf_model("llama", 259).vocab_size == 259


# ----------------------------------------------------------------------- model.path


def saved_model(tmp_path, **overrides):
    """A model written by plain transformers' save_pretrained (the test's own object)."""
    table = hf_config("llama", vocab_size=VOCAB, **overrides)
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path)
    return model


def test_a_saved_directory_loads_with_its_exact_weights(tmp_path):
    reference = saved_model(tmp_path)
    model = build_model(ModelConfig(source="hf", path=str(tmp_path)), VOCAB, seed=0)
    expected = reference.state_dict()
    got = {k.removeprefix("hf."): v for k, v in model.state_dict().items()}
    assert set(got) == set(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    ids = torch.tensor([[3, 9, 1, 4, 4, 2]])
    one = packed_batch([[ids[0].tolist()]], 6)
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        exact = copy.deepcopy(reference).double()(input_ids=ids).logits
        # the same weights and computation up to rounding: within twice plain
        # transformers' own fp32 distance from its float64 forward (``spread_bound``)
        assert float((model.logits(model(one)) - want).abs().max()) <= spread_bound(want, exact)


@pytest.mark.parametrize("damage, needle", [
    ("nothing there", "does not exist"),
    ("no config.json", "has no config.json"),
    ("no weights", "has no safetensors weights"),
    ("a weight removed", "lack or mis-shape 1 tensor(s), e.g. lm_head.weight"),
])
def test_missing_model_files_are_one_error_naming_the_path(tmp_path, damage, needle):
    directory = tmp_path / "model"
    if damage != "nothing there":
        saved_model(directory)
    weights = directory / "model.safetensors"
    if damage == "no config.json":
        (directory / "config.json").unlink()
    elif damage == "no weights":
        weights.unlink()
    elif damage == "a weight removed":
        tensors = load_file(weights)
        del tensors["lm_head.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ModelError) as info:
        build_model(ModelConfig(source="hf", path=str(directory)), VOCAB, seed=0)
    assert needle in str(info.value) and str(directory) in str(info.value)


# ----------------------------------------------------------------------- refusals (R3)


@pytest.mark.parametrize("backend", ["flash_attention_2", "flex_attention", "paged|sdpa"])
def test_a_backend_that_cannot_isolate_segments_is_refused(backend):
    with pytest.raises(ModelError) as info:
        hf_model("qwen2", VOCAB, attn=backend)
    assert f"model type qwen2 with attn_implementation {backend!r}" in str(info.value)


def test_the_probe_refuses_a_real_architecture_that_leaks_r3():
    """Jamba with one Mamba and one attention layer: the recurrent state carries the
    first document into the second, whatever the mask says."""
    table = {"model_type": "jamba", "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "attn_layer_period": 2, "attn_layer_offset": 1, "num_experts": 1}
    with pytest.raises(ModelError) as info:
        build_model(ModelConfig(source="hf", hf_config=table), VOCAB, seed=0)
    assert "model type jamba with attn_implementation 'sdpa' does not isolate" in str(info.value)


def test_the_probe_refuses_when_the_mask_is_withheld(monkeypatch):
    """Negative control of the probe: the adapter's mask withheld (and HF's own position
    inference off, as with a cache) must be caught at build time."""
    monkeypatch.setattr(hf.HFCausalLM, "attention_mask", lambda self, *visibility: None)
    monkeypatch.setattr(hf, "probe_batch", lambda vocab, **kw: without_positions(vocab, **kw))
    with pytest.raises(ModelError, match="llama with attn_implementation 'sdpa' does not isolate"):
        hf_model("llama", VOCAB)


def without_positions(vocab, **kw):
    """The probe's row with positions counted along the row (no document restarts)."""
    b = PROBE_BATCH(vocab, **kw)
    return dataclasses.replace(b, position_ids=torch.arange(b.shape[1]).expand(b.shape).clone())


@pytest.mark.parametrize("family, overrides, needle", [
    ("gemma2", {"head_dim": 8}, "final logit soft-capping (final_logit_softcapping = 30.0)"),
    ("cohere", {}, "a final logit scale (logit_scale = 0.0625)"),
    ("granite", {"logits_scaling": 4.0}, "a final logit scale (logits_scaling = 4.0)"),
    ("phi", {}, "an lm_head bias"),
])
def test_a_head_that_is_not_a_plain_linear_map_is_refused_l1(family, overrides, needle):
    table = {"model_type": family, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             **overrides}
    with pytest.raises(ModelError) as info:
        build_model(ModelConfig(source="hf", hf_config=table), VOCAB, seed=0)
    assert needle in str(info.value) and family in str(info.value)


def test_the_probe_refuses_a_nonlinear_head_it_was_not_told_about(monkeypatch):
    """Negative control of the named list: without it the probe still sees Cohere's scale."""
    monkeypatch.setattr(hf, "HEAD_FEATURES", ())
    table = {"model_type": "cohere", "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(ModelError, match="cohere is not a plain linear map"):
        build_model(ModelConfig(source="hf", hf_config=table), VOCAB, seed=0)


def test_batch_dependent_rope_is_refused_r3():
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ModelError, match="rope_type 'dynamic'"):
        hf_model("llama", VOCAB, rope_parameters=rope)


def test_vocabulary_rule_names_both_sizes():
    with pytest.raises(ModelError) as info:
        hf_model("llama", 259, vocab_size=100)
    assert "tokenizer has 259 tokens but the llama model's vocabulary has 100" in str(info.value)
    padded = hf_model("llama", 259, vocab_size=320)  # a padded embedding is allowed
    assert padded.head_weight.shape == (320, 32)


def test_rows_beyond_positions_or_an_unrealised_sliding_window_are_refused():
    """A window the build-time probe crosses is realised (tests/model/test_hf_windows.py);
    one longer than the probe reaches is a refusal for longer rows."""
    model = hf_model("mistral", VOCAB, sliding_window=8)
    model(packed_batch([[[1] * 12]], 12))  # realised: rows longer than the window are fine
    wide = hf_model("mistral", VOCAB, sliding_window=2000, max_position_embeddings=4096)
    wide.check_rows(2000)
    with pytest.raises(ModelError, match="sliding_window = 2000 .sliding attention."):
        wide(packed_batch([[[1] * 2001]], 2001))
    short = hf_model("gpt2", VOCAB, n_positions=12)
    with pytest.raises(ModelError, match="max_position_embeddings = 12"):
        short(packed_batch([[[1] * 13]], 13))


def test_hf_config_typos_and_unknown_model_types_are_refused():
    with pytest.raises(ConfigError, match="model.hf_config.hiden_size is not a key of LlamaConfig"):
        build_model(hf_model_config("llama", hiden_size=3), VOCAB, seed=0)
    with pytest.raises(ModelError, match="'nosuch' is not a model type"):
        build_model(ModelConfig(source="hf", hf_config={"model_type": "nosuch"}), VOCAB, seed=0)


def test_a_config_json_rope_theta_is_taken_and_reaches_the_rotary_tables():
    """config.json files (Qwen2.5's among them) spell the RoPE base ``rope_theta``; the
    installed transformers stores it in ``rope_parameters``. It must be accepted and
    used: the rotary inverse frequencies are ``theta ** (-2i / d)`` (negative control:
    the default base gives other frequencies)."""
    dims = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=64, num_hidden_layers=1)
    model = build_model(hf_model_config("qwen2", rope_theta=1000.0, **dims), VOCAB, seed=0)
    default = build_model(hf_model_config("qwen2", **dims), VOCAB, seed=0)
    head_dim = 16
    expected = 1000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def inv_freq(adapter):
        return next(b for n, b in adapter.hf.named_buffers() if n.endswith("inv_freq")).double()

    # fp32 ``1 / theta ** (2i / d)`` (exact exponents): a faithful pow (< 1 ulp: 2u
    # relatively) and a rounded quotient, so within gamma(4) of the float64 values
    torch.testing.assert_close(inv_freq(model), expected, rtol=gamma(4), atol=0)
    assert not torch.allclose(inv_freq(default), expected)


def test_the_probe_leaves_modes_and_streams_as_they_were():
    model = hf_model("gpt2", VOCAB)
    model.train()
    before = rng_streams()
    hf.probe(model, VOCAB)
    assert model.training and all(m.training for m in model.modules())
    assert same_streams(before, rng_streams())
    assert all(p.grad is None for p in model.parameters())
