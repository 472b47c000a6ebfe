"""The ``model`` keys of a Hugging Face model (X2): ``source``, ``path``, ``hf_config``
(a table: TOML, or a JSON object from ``--set``), ``attn_implementation``.

The defaults leave the built-in decoder unchanged; a table is recorded in the
manifest exactly as given and survives the round trip through it (resume).
"""

from __future__ import annotations

import pytest

from exactstep.config import config_from_manifest, load_config
from exactstep.errors import ConfigError
from exactstep.model.config import ModelConfig
from exactstep.state.manifest import build_manifest, canonical_json

TABLE = {"model_type": "llama", "hidden_size": 32, "rope_parameters":
         {"rope_type": "default", "rope_theta": 10000.0}, "layer_types": ["full_attention"] * 2,
         "tie_word_embeddings": True, "pad_token_id": None}
TOML = """[model]
source = "hf"
attn_implementation = "eager"

[model.hf_config]
model_type = "llama"
hidden_size = 32
tie_word_embeddings = true
layer_types = ["full_attention", "full_attention"]
pad_token_id = 0

[model.hf_config.rope_parameters]
rope_type = "default"
rope_theta = 10000.0
"""


def test_defaults_are_the_builtin_decoder():
    cfg = ModelConfig()
    assert (cfg.source, cfg.path, cfg.hf_config, cfg.attn_implementation) == (
        "builtin", None, {}, "auto")


def test_a_toml_table_is_read_with_its_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    cfg = load_config(path).model
    assert cfg.source == "hf" and cfg.attn_implementation == "eager"
    assert cfg.hf_config == {"model_type": "llama", "hidden_size": 32,
                             "tie_word_embeddings": True, "pad_token_id": 0,
                             "layer_types": ["full_attention", "full_attention"],
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert type(cfg.hf_config["rope_parameters"]["rope_theta"]) is float


def test_a_json_object_from_set_and_the_manifest_round_trip():
    import json

    cfg = load_config(overrides=["model.source=hf", f"model.hf_config={json.dumps(TABLE)}"])
    assert cfg.model.hf_config == TABLE
    body = {"config": cfg.to_dict()}
    manifest = build_manifest({**{name: {} for name in ("data", "representation", "batch",
                               "objective", "update", "numerics", "parallel", "seeds",
                               "code")}, **body})
    assert json.loads(canonical_json(manifest.body))["config"]["model"]["hf_config"] == TABLE
    assert config_from_manifest(manifest) == cfg


@pytest.mark.parametrize("value, needle", [
    ("[1, 2]", "model.hf_config must be a table"),
    ("{model_type: llama}", "model.hf_config must be a table: a TOML table, or from --set"),
    ('{"model_type": "llama", "x": NaN}', "model.hf_config.x must be a finite number"),
    ('{"model_type": "llama", "x": [1, Infinity]}', "model.hf_config.x.1 must be a finite"),
    ('{"hidden_size": 32}', "model.hf_config needs a string model_type"),
])
def test_bad_tables_are_refused_naming_the_key(value, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_config(overrides=["model.source=hf", f"model.hf_config={value}"])


def test_a_toml_date_is_not_plain_data(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nsource = "hf"\n[model.hf_config]\nmodel_type = "llama"\n'
                    "when = 1979-05-27\n")
    with pytest.raises(ConfigError, match="model.hf_config.when must hold plain values"):
        load_config(path)


@pytest.mark.parametrize("overrides, needle", [
    (["model.path=/models/x"], "model.path is set but model.source = 'builtin'"),
    (['model.hf_config={"model_type": "llama"}'], "model.hf_config is set but model.source"),
    (["model.source=hf"], "needs exactly one of model.path"),
    (["model.source=hf", "model.path=/m", 'model.hf_config={"model_type": "llama"}'],
     "needs exactly one of model.path"),
])
def test_source_and_its_keys_must_agree(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=overrides)


def test_set_inside_the_table_reads_json_literals_and_keeps_the_rest(tmp_path):
    """``--set model.hf_config.KEY=V`` changes one key of the file's table: ``V`` as a
    JSON literal where it is one (an HF config validates types strictly), else as the
    string given; the other keys stay as the file has them."""
    path = tmp_path / "run.toml"
    path.write_text(TOML, encoding="utf-8")
    cfg = load_config(path, ["model.hf_config.num_hidden_layers=6",
                             "model.hf_config.rms_norm_eps=1e-6",
                             "model.hf_config.tie_word_embeddings=false",
                             "model.hf_config.hidden_act=gelu",
                             "model.hf_config.rope_parameters.rope_theta=500000.0"])
    table = cfg.model.hf_config
    assert table["num_hidden_layers"] == 6 and type(table["num_hidden_layers"]) is int
    assert table["rms_norm_eps"] == 1e-6 and type(table["rms_norm_eps"]) is float
    assert table["tie_word_embeddings"] is False
    assert table["hidden_act"] == "gelu"
    assert table["rope_parameters"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert table["hidden_size"] == 32 and table["model_type"] == "llama"
    # a typed key outside a table is still coerced by its field (control: a string there)
    assert load_config(path, ["batch.rows=3"]).batch.rows == 3
    assert load_config(path, ["model.attn_implementation=sdpa"]).model.attn_implementation == "sdpa"


def test_an_invalid_value_inside_the_table_names_the_reason():
    """HF's validator puts the reason on a second line; the one error line carries it."""
    from exactstep.errors import ModelError
    from exactstep.model.hf import build_hf_model

    cfg = ModelConfig(source="hf", hf_config={"model_type": "qwen2", "num_hidden_layers": "6"})
    with pytest.raises(ModelError, match="num_hidden_layers.*expected int, got str") as info:
        build_hf_model(cfg, 259, seed=0)
    assert "\n" not in str(info.value)
