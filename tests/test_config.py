"""X2/X4: configuration from TOML + --set, with typed errors that name the key."""

from __future__ import annotations

import dataclasses
import functools
import math

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
        ("train.loader=fork", "train.loader"),
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


# --------------------------------------------------------------------------- ranges

F32_TINY, F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38  # numpy.finfo(float32)
F32 = "in [1.18e-38, 3.4e+38] (a positive normal float32)"
I64_MAX = 2**63 - 1

# Every numeric key: values at the edge of its range that are accepted, values just
# outside that are refused, and the range the refusal must state. Extra overrides
# make a value legal in context (e.g. d_model with n_heads).
RANGES: list[tuple[str, tuple, tuple, str, tuple[str, ...]]] = [
    ("seed", (0, I64_MAX), (-1,), "in [0, 2**63 - 1]", ()),
    ("data.val_fraction", (1e-9, 0.999), (0, 1, -0.5), "in (0, 1)", ()),
    ("data.max_docs", (0,), (-1,), ">= 0", ()),
    ("batch.seq_len", (2,), (1, 0), ">= 2", ()),
    ("batch.rows", (1,), (0,), ">= 1", ()),
    ("batch.buffer", (1,), (0,), ">= 1", ()),
    ("model.d_model", (2,), (0,), ">= 1", ("model.n_heads=1",)),
    ("model.n_layers", (1,), (0,), ">= 1", ()),
    ("model.n_heads", (1,), (0, -2), ">= 1", ()),
    ("model.d_ff", (1,), (0,), ">= 1", ()),
    ("model.rope_theta", (F32_TINY, F32_MAX), (0, -1, 1e-39, 3.5e38), F32, ()),
    ("model.norm_eps", (F32_TINY, 1e-5), (0, -1, 1e-300, 1e39), F32, ()),
    ("model.init_std", (F32_TINY, F32_MAX), (0, -1, 1e-40, 1e300), F32, ()),
    ("model.lora.r", (0, 8), (-1,), ">= 0", ()),
    ("model.lora.alpha", (1e-9, 16.0), (0, -1), "> 0", ()),
    ("model.lora.dropout", (0, 0.999), (1, -0.1), "in [0, 1)", ()),
    ("objective.label_smoothing", (0, 1), (-0.1, 1.1), "in [0, 1]", ()),
    ("objective.chunk_rows", (0,), (-1,), ">= 0", ()),
    ("update.accum", (1,), (0,), ">= 1", ()),
    ("update.lr", (1e-300, 10.0), (0, -1e-3), "> 0", ()),
    ("update.min_lr_ratio", (0, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("update.warmup", (0,), (-1,), ">= 0", ()),
    ("update.decay_steps", (0,), (-1,), ">= 0", ()),
    ("update.decay_fraction", (0, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("update.clip", (0,), (-1,), ">= 0", ()),
    ("update.weight_decay", (0,), (-0.1,), ">= 0", ()),
    ("update.beta1", (0, 0.999), (1, -0.1), "in [0, 1)", ()),
    ("update.beta2", (0, 0.999), (1, -0.1), "in [0, 1)", ()),
    ("update.eps", (F32_TINY, 1.0), (0, -1e-8, 1e-300), F32, ()),
    ("update.momentum", (0, 0.99), (1, -0.1), "in [0, 1)", ()),
    ("update.fail_window", (-1, 0), (-2,), ">= -1", ()),
    ("numerics.init_scale", (1.0, F32_MAX), (0, -1, 1e39), F32, ()),
    ("train.steps", (1,), (0,), ">= 1", ()),
    ("train.eval_every", (0,), (-1,), ">= 0", ()),
    ("train.eval_tokens", (1,), (0,), ">= 1", ()),
    ("train.log_every", (1,), (0,), ">= 1", ()),
    ("train.threads", (0,), (-1,), ">= 0", ()),
    ("train.prefetch", (0, 64), (-1, 65), "in [0, 64]", ()),
    ("scheduled_sampling.k", (1.0, 1e6), (0.5, 0), ">= 1", ()),
    ("scheduled_sampling.slope", (0, 0.5), (-0.1,), ">= 0", ()),
    ("scheduled_sampling.base", (1e-9, 1.0), (0, -0.1, 1.1), "in (0, 1]", ()),
    ("scheduled_sampling.probability", (0, 1), (-0.1, 1.1), "in [0, 1]", ()),
    ("scheduled_sampling.floor", (0, 1), (-0.1, 1.1), "in [0, 1]", ()),
    ("checkpoint.every", (0,), (-1,), ">= 0", ()),
    ("checkpoint.keep", (1,), (0,), ">= 1", ()),
    ("parallel.timeout_s", (1e-9, 1e9), (0, -1, 1.1e9), "in (0, 1000000000]", ()),
    ("parallel.bucket_mb", (1,), (0,), ">= 1", ()),
    ("parallel.tp", (1,), (0,), ">= 1", ()),
    ("parallel.pp", (1,), (0,), ">= 1", ()),
    ("parallel.cp", (1,), (0,), ">= 1", ()),  # above 1: refused as unrun (test_bad_inputs)
    ("parallel.ep", (1,), (0,), ">= 1", ()),
    ("arith.n_train", (1,), (0,), ">= 1", ()),
    ("arith.n_heldout", (1,), (0,), ">= 1", ()),
    ("arith.max_operand", (1,), (0,), ">= 1", ()),
    ("arith.max_multiplier", (2,), (1,), ">= 2", ()),
    ("arith.min_follow_ups", (0, 1), (-1,), ">= 0", ()),
    ("arith.max_follow_ups", (1, 9), (0,), ">= arith.min_follow_ups (1)", ()),
    ("arith.max_new_tokens", (1,), (0,), ">= 1", ()),
    ("permutation.predict_one_in", (1,), (0, -1), ">= 1", ()),
    ("encdec.encoder_layers", (0, 3), (-1,), ">= 0", ()),
    ("encdec.decoder_layers", (0, 3), (-1,), ">= 0", ()),
    ("encdec.source_len", (0, 64), (-1,), ">= 0", ()),
    ("encdec.source_pad_id", (-1, 0), (-2,), ">= -1", ()),
    ("encdec.n_train", (1,), (0,), ">= 1", ()),
    ("encdec.n_heldout", (1,), (0,), ">= 1", ()),
    ("encdec.max_value", (0,), (-1,), ">= 0", ()),
    ("encdec.max_new_tokens", (1,), (0,), ">= 1", ()),
    ("span.noise_density", (0.01, 0.5, 0.99), (0, 1, -0.1), "in (0, 1)", ()),
    ("span.mean_noise_span_length", (1, 3.0), (0.5, 0, -1), ">= 1", ()),
    ("span.sentinels", (1, 100), (0, -1), ">= 1", ()),
    ("bart.token_masking_rate", (0, 0.15, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("bart.token_deletion_rate", (0, 0.15, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("bart.text_infilling_rate", (0, 0.3, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("bart.poisson_lambda", (1e-9, 3.0, 50.0), (0, -1), "> 0", ()),
    ("mass.fraction", (1e-9, 0.5, 1), (0, -0.1, 1.5), "in (0, 1]", ()),
    ("mass.mask_rate", (1.0,), (-0.1, 1.5), "in [0, 1]",
     ("mass.random_rate=0.0", "mass.keep_rate=0.0")),
    ("mass.random_rate", (1.0,), (-0.1, 1.5), "in [0, 1]",
     ("mass.mask_rate=0.0", "mass.keep_rate=0.0")),
    ("mass.keep_rate", (1.0,), (-0.1, 1.5), "in [0, 1]",
     ("mass.mask_rate=0.0", "mass.random_rate=0.0")),
    ("mlm.mask_rate", (1e-9, 0.15, 1), (0, -0.1, 1.5), "in (0, 1]", ()),
    ("mlm.replace_mask", (0, 1), (-0.1, 1.5), "in [0, 1]", ("mlm.replace_random=0",)),
    ("mlm.replace_random", (0, 1), (-0.1, 1.5), "in [0, 1]", ("mlm.replace_mask=0",)),
    ("policy.ngram", (1, 16), (0, 17), "in [1, 16]", ()),
    ("policy.decay", (0, 1), (-0.1, 1.5), "in [0, 1]", ()),
    ("policy.regressor_lr", (1e-4, 1.0), (0.0, -1.0), "> 0", ()),
    ("policy.std_eps", (0, 1e-3), (-1e-9,), ">= 0", ()),
    ("policy.constant", (1e-9, 1e6), (0, -1), "> 0", ()),
    ("policy.beta", (0, 0.1), (-0.1,), ">= 0", ()),
    ("policy.delta_start", (0, 5), (-1,), ">= 0", ()),
    ("policy.delta_step", (0, 2), (-1,), ">= 0", ()),
    ("policy.delta_every", (1, 100), (0,), ">= 1", ()),
    ("policy.delta_max", (0, 9), (-1,), ">= 0", ()),
    ("policy.epochs", (1, 4, 1024), (0, 1025), "in [1, 1024]", ()),
    ("policy.clip_ratio", (1e-9, 0.2, 1), (0, -0.1, 1.5), "in (0, 1]", ()),
    ("policy.clip_ratio_high", (0, 0.28, 2), (-0.1,), ">= 0", ()),
    ("generation.temperature", (0, 0.7, 2.0), (-0.1,), ">= 0", ()),
    ("generation.top_k", (0, 50), (-1,), ">= 0", ()),
    ("generation.top_p", (1e-9, 0.9, 1), (0, -0.1, 1.1), "in (0, 1]", ()),
    ("generation.max_new_tokens", (1, 64), (0,), "in [1, 1048576]", ()),
    ("generation.samples", (1, 8), (0,), "in [1, 65536]", ()),
    ("generation.batch_rows", (0, 64), (-1,), "in [0, 65536]", ()),
    ("professor.lambda_free", (0, 0.5, 10), (-0.1, -1), ">= 0 (a negative", ()),
    ("professor.lambda_forced", (0, 0.5), (-1e-9,), ">= 0 (a negative", ()),
    ("professor.d_steps", (1, 64), (0, 65), "in [1, 64]", ()),
    ("professor.d_hidden", (1, 4096), (0, 4097), "in [1, 4096]", ()),
    ("professor.d_lr", (1e-6, 10), (0, -1, 11), "in (0, 10]", ()),
    ("professor.d_warmup", (0, 10), (-1,), ">= 0", ()),
    ("professor.d_clip", (0, 1.5), (-0.1,), ">= 0", ()),
    ("professor.d_weight_decay", (0, 0.1), (-0.1,), ">= 0", ()),
    ("professor.fail_window", (-1, 0, 3), (-2,), ">= -1", ()),
]


def numeric_keys() -> set[str]:
    return {key for key, _, kind in config_keys() if kind in ("int", "float")}


def test_the_range_table_covers_every_numeric_key() -> None:
    """A numeric key added without a range (and a row here) fails this test."""
    assert {row[0] for row in RANGES} == numeric_keys()


@pytest.mark.parametrize(("key", "accepted", "refused", "allowed", "extra"), RANGES,
                         ids=[row[0] for row in RANGES])
def test_each_numeric_key_accepts_its_range_and_refuses_outside_it(
    key: str, accepted: tuple, refused: tuple, allowed: str, extra: tuple[str, ...]
) -> None:
    section, _, name = key.rpartition(".")
    for value in accepted:
        cfg = load_config(overrides=[*extra, f"{key}={value!r}"])
        got = getattr(functools.reduce(getattr, section.split("."), cfg) if section else cfg,
                      name)
        assert got == value, (key, value, got)
    for value in refused:
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[*extra, f"{key}={value!r}"])
        message = str(info.value)
        assert message.startswith(f"{key} must be ") and allowed in message, message


def float_keys() -> list[str]:
    return sorted(key for key, _, kind in config_keys() if kind == "float")


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_no_float_key_accepts_a_non_finite_value(text: str) -> None:
    """A non-finite float is refused for every float key, naming the key."""
    for key in float_keys():
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[f"{key}={text}"])
        assert str(info.value).startswith(f"{key} must be a finite number"), str(info.value)


def refuses_nan(section: object, name: str) -> bool:
    """Whether building ``section`` with ``name = NaN`` in Python (no string
    coercion) raises ``ConfigError``: the section's own check must refuse NaN."""
    try:
        dataclasses.replace(section, **{name: math.nan})
    except ConfigError:
        return True
    return False


def test_every_section_refuses_nan_itself() -> None:
    """Sections built in code (no ``--set``) refuse NaN too: every range check is
    written so that NaN fails it."""
    cfg = RunConfig()
    for key in float_keys():
        section, _, name = key.rpartition(".")  # a nested section: model.lora.alpha
        assert refuses_nan(functools.reduce(getattr, section.split("."), cfg), name), key


def test_negative_control_a_less_than_check_lets_nan_through() -> None:
    """The probe above can fail: a section whose check is ``if x < 0: raise`` (as
    update.weight_decay had) accepts NaN."""
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class LessThanCheck:
        weight_decay: float = 0.1

        def __post_init__(self) -> None:
            if self.weight_decay < 0:
                raise ConfigError("weight_decay must be >= 0")

    assert not refuses_nan(LessThanCheck(), "weight_decay")
    with pytest.raises(ConfigError):
        LessThanCheck(weight_decay=-1.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("9007199254740993", 9007199254740993), ("1e3", 1000), ("3.0", 3), (" 7 ", 7),
     ("9223372036854775807", 2**63 - 1)],
)
def test_integers_are_parsed_exactly(text: str, expected: int) -> None:
    """2**53 + 1 survives: the digits are parsed as an integer, not as a float."""
    assert load_config(overrides=[f"seed={text}"]).seed == expected


def test_negative_control_float_parsing_would_round_a_long_integer() -> None:
    """Why the parser above avoids floats: the route through ``float`` (the old
    coercion) turns 2**53 + 1 into 2**53."""
    assert int(float("9007199254740993")) == 2**53 != 9007199254740993


@pytest.mark.parametrize("text", ["9223372036854775808", "1e30", "1e400000000", "nan", "inf",
                                  "1.5", "0x10", "", "true"])
def test_integers_outside_64_bits_or_not_integral_are_refused(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"train.steps={text}"])
    assert str(info.value).startswith("train.steps must be an integer")


def test_toml_values_go_through_the_same_checks(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[update]\nweight_decay = nan\n")  # TOML has a nan literal
    with pytest.raises(ConfigError, match="update.weight_decay must be a finite number"):
        load_config(path)
    path.write_text("[model]\nnorm_eps = -1.0\n")
    with pytest.raises(ConfigError, match="model.norm_eps must be in"):
        load_config(path)


def test_unreadable_config_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[data]\nsource = "caf\xe9.jsonl"\n')
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xe9 at offset 20\)"):
        load_config(latin1)


# --------------------------------------------------------------------------- a section from --set


def test_a_section_takes_a_json_object_from_set(tmp_path) -> None:
    """X2: ``--set SECTION={json}`` sets each key as ``--set SECTION.key=value`` would;
    keys it does not name keep their values (TOML's, then the defaults)."""
    cfg = load_config(overrides=['model.lora={"r": 4, "alpha": 8}'])
    assert cfg.model.lora == load_config(overrides=["model.lora.r=4", "model.lora.alpha=8"]).model.lora
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.dropout) == (4, 8.0, 0.0)
    assert type(cfg.model.lora.alpha) is float  # coerced to the field's type, as from TOML
    path = tmp_path / "run.toml"
    path.write_text("[update]\nlr = 0.01\naccum = 2\n")
    cfg = load_config(path, ['update={"accum": 3, "clip": "0.5"}'])
    assert (cfg.update.lr, cfg.update.accum, cfg.update.clip) == (0.01, 3, 0.5)
    nested = load_config(overrides=['model={"n_layers": 3, "lora": {"r": 2}}'])
    assert (nested.model.n_layers, nested.model.lora.r) == (3, 2)
    assert load_config(overrides=["model.lora={}"]) == RunConfig()


def test_a_section_from_set_applies_to_a_resumed_config() -> None:
    """``apply_overrides`` (``resume --set``) reads a section's JSON object the same way."""
    from exactstep.config import apply_overrides

    base = load_config(overrides=["model.lora.dropout=0.1"])
    cfg = apply_overrides(base, ['model.lora={"r": 4}'])
    assert (cfg.model.lora.r, cfg.model.lora.dropout) == (4, 0.1)


def test_a_table_valued_key_still_takes_its_json_whole() -> None:
    """``model.hf_config`` is a key holding a free table, not a section: its JSON object
    is the value itself, including keys no dataclass declares."""
    cfg = load_config(overrides=['model.hf_config={"model_type": "llama", "rope_scaling": {"a": 1}}',
                                 "model.source=hf"])
    assert cfg.model.hf_config == {"model_type": "llama", "rope_scaling": {"a": 1}}


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ('model.lora={"rank": 4}', "unknown config key 'model.lora.rank'; known keys here: "
                                   "model.lora.r, model.lora.alpha"),
        ('model={"lora": {"rank": 4}}', "unknown config key 'model.lora.rank'"),
        ('model={"n_layer": 4}', "unknown config key 'model.n_layer'"),
        ('model.lora={"r": -1}', "model.lora.r must be >= 0"),
        ('model.lora={"r": 1.5}', "model.lora.r must be an integer"),
        ('model.lora={"alpha": NaN}', "model.lora.alpha must be a finite number"),
        ('update={"lr": "fast"}', "update.lr must be a number"),
        ('model.lora={"bias": "all"}', "model.lora.bias must be one of none"),
        ('model={"lora": 4}', "'model.lora' is a section"),
        ("model.lora=4", "'model.lora' is a section"),
        ("model.lora=[4]", "'model.lora' is a section"),
        ('model.lora={"r": 4', "'model.lora' is a section"),
        ('model.lora={"r": 4, "r": 8}', "model.lora: its JSON object gives the key 'r' twice"),
    ],
)
def test_a_section_from_set_names_the_full_key(override: str, needle: str) -> None:
    """X4: every key inside the object is checked as TOML's would be, and a refusal is
    one line naming the full dotted key."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    assert needle in str(info.value)
    assert "\n" not in str(info.value)
