"""X2/X4: configuration from TOML + --set, with typed errors that name the key."""

from __future__ import annotations

import pytest

from exactstep.config import RunConfig, config_keys, load_config
from exactstep.errors import ConfigError


def test_defaults_resolve() -> None:
    cfg = load_config()
    assert cfg == RunConfig()


def test_toml_then_overrides_win(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('seed = 3\n[update]\nlr = 0.01\naccum = 2\n[numerics]\nprecision = "bf16"\n')
    cfg = load_config(path, ["update.lr=5e-4", "model.tie_embeddings=false", "seed=7"])
    assert cfg.seed == 7
    assert cfg.update.lr == 5e-4
    assert cfg.update.accum == 2
    assert cfg.numerics.precision == "bf16"
    assert cfg.model.tie_embeddings is False


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("update.lrr=1", "update.lrr"),
        ("nosuch.key=1", "nosuch"),
        ("update.accum=0", "update.accum"),
        ("update.accum=1.5", "update.accum"),
        ("update.lr=fast", "update.lr"),
        ("numerics.precision=fp8", "numerics.precision"),
        ("batch.seq_len=1", "batch.seq_len"),
        ("model.tie_embeddings=maybe", "model.tie_embeddings"),
        ("model.n_heads=3", "model.n_heads"),
        ("update=3", "update"),
        ("no_equals_sign", "key=value"),
    ],
)
def test_bad_values_name_the_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[update\nlr = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_every_key_is_listed_once() -> None:
    keys = [k for k, _, _ in config_keys()]
    assert len(keys) == len(set(keys))
    for required in ("seed", "data.source", "batch.seq_len", "batch.rows", "update.accum",
                     "update.lr", "update.clip", "train.steps", "numerics.precision",
                     "checkpoint.every", "checkpoint.keep", "model.d_model", "model.n_layers"):
        assert required in keys
