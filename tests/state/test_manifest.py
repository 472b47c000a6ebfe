"""S1: canonical JSON, digest, immutability, and naming of differing fields (S4)."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exactstep.errors import CheckpointError, ConfigError, ResumeError
from exactstep.state.manifest import (
    REQUIRED_SECTIONS,
    Manifest,
    build_manifest,
    canonical_json,
    diff_manifests,
    read_manifest,
    write_manifest,
)


def sections(**changes: dict) -> dict:
    base = {name: {} for name in REQUIRED_SECTIONS}
    base["batch"] = {"seq_len": 256, "rows": 8, "packing": "bfd"}
    base["update"] = {"lr": 3e-4, "betas": [0.9, 0.95], "accum": 4}
    base["seeds"] = {"seed": 0}
    for name, value in changes.items():
        base[name] = {**base[name], **value}
    return base


# ------------------------------------------------------------ canonical bytes


def test_canonical_json_exact_bytes() -> None:
    obj = {"b": 1, "a": [0.1, 1e-05, 2.0, -0.0, True, None], "é": "ü"}
    assert canonical_json(obj) == '{"a":[0.1,1e-05,2.0,-0.0,true,null],"b":1,"é":"ü"}\n'.encode()


def test_int_and_float_are_different_declarations() -> None:
    assert canonical_json({"x": 1}) != canonical_json({"x": 1.0})


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_refused_naming_path(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"update\.lr"):
        canonical_json({"update": {"lr": bad}})


def test_non_plain_values_and_keys_refused() -> None:
    with pytest.raises(ConfigError, match=r"data\.path"):
        canonical_json({"data": {"path": object()}})
    with pytest.raises(ConfigError, match="keys must be strings"):
        canonical_json({"data": {1: "x"}})


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_tree = st.recursive(
    json_leaf,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=20,
)


def noncanonical_json(obj) -> bytes:
    """Deliberately wrong: insertion-ordered keys and default separators."""
    return (json.dumps(obj) + "\n").encode()


def reversed_keys(obj):
    if isinstance(obj, dict):
        return {k: reversed_keys(obj[k]) for k in reversed(list(obj))}
    if isinstance(obj, list):
        return [reversed_keys(v) for v in obj]
    return obj


@settings(max_examples=150, deadline=None)
@given(json_tree)
def test_canonical_json_round_trips_and_ignores_key_order(obj) -> None:
    data = canonical_json(obj)
    assert json.loads(data) == obj
    assert canonical_json(json.loads(data)) == data  # a fixed point
    assert canonical_json(reversed_keys(obj)) == data


def test_key_order_check_catches_noncanonical_serialiser() -> None:
    """Negative control: the same stability check fails for a non-canonical writer."""
    obj = {"b": 1, "a": {"d": 2, "c": 3}}
    assert noncanonical_json(reversed_keys(obj)) != noncanonical_json(obj)
    assert canonical_json(reversed_keys(obj)) == canonical_json(obj)


# ------------------------------------------------------------ building


def test_digest_is_sha256_of_canonical_body() -> None:
    m = build_manifest(sections())
    assert m.digest == hashlib.sha256(canonical_json(m.to_dict())).hexdigest()
    # the same bytes spelled out with the standard library (S1: sorted keys, compact
    # separators, UTF-8, one trailing newline)
    text = json.dumps(sections(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert m.digest == hashlib.sha256((text + "\n").encode()).hexdigest()
    assert build_manifest(reversed_keys(sections())).digest == m.digest


def test_manifest_body_is_read_only() -> None:
    m = build_manifest(sections())
    with pytest.raises(TypeError):
        m.body["update"]["lr"] = 1.0  # type: ignore[index]
    assert isinstance(m.body["update"]["betas"], tuple)


def test_missing_and_forbidden_sections_refused() -> None:
    s = sections()
    del s["seeds"]
    with pytest.raises(ConfigError, match="seeds"):
        build_manifest(s)
    with pytest.raises(ConfigError, match="progress"):
        build_manifest({**sections(), "progress": {"committed": 3}})


def test_extra_sections_allowed() -> None:
    m = build_manifest({**sections(), "model": {"d_model": 128}})
    assert m.body["model"]["d_model"] == 128


# ------------------------------------------------------------ files


def test_write_read_round_trip(tmp_path) -> None:
    m = build_manifest(sections())
    write_manifest(tmp_path, m)
    doc = json.loads((tmp_path / "manifest.json").read_bytes())
    assert doc["digest"] == m.digest
    back = read_manifest(tmp_path)
    assert back == m
    assert back.to_dict() == m.to_dict()
    assert not [p for p in tmp_path.iterdir() if p.name != "manifest.json"]  # no temporaries left


def test_manifest_is_immutable(tmp_path) -> None:
    m = build_manifest(sections())
    write_manifest(tmp_path, m)
    write_manifest(tmp_path, build_manifest(reversed_keys(sections())))  # same digest: no-op
    before = (tmp_path / "manifest.json").read_bytes()
    other = build_manifest(sections(update={"lr": 1e-3}))
    with pytest.raises(ResumeError, match=r"update\.lr"):
        write_manifest(tmp_path, other)
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_read_detects_edited_manifest(tmp_path) -> None:
    write_manifest(tmp_path, build_manifest(sections()))
    path = tmp_path / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"lr":0.0003', b'"lr":0.0004'))
    with pytest.raises(CheckpointError, match="manifest.json is corrupted"):
        read_manifest(tmp_path)


def test_read_missing_manifest_names_file(tmp_path) -> None:
    with pytest.raises(ResumeError, match="manifest.json does not exist"):
        read_manifest(tmp_path)


def test_read_garbage_manifest(tmp_path) -> None:
    (tmp_path / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_manifest(tmp_path)


# ------------------------------------------------------------ diff


def test_diff_names_every_changed_field() -> None:
    a = build_manifest(sections())
    b = build_manifest(
        sections(update={"lr": 1e-3, "betas": [0.9, 0.99]}, batch={"seq_len": 512, "new_key": 1})
    )
    assert diff_manifests(a, b) == ["batch.new_key", "batch.seq_len", "update.betas.1", "update.lr"]
    assert diff_manifests(a, a) == []


def test_diff_separates_int_from_float() -> None:
    a = build_manifest(sections(update={"accum": 4}))
    b = build_manifest(sections(update={"accum": 4.0}))
    assert a.digest != b.digest
    assert diff_manifests(a, b) == ["update.accum"]


def test_diff_of_lists_with_different_lengths_names_the_list() -> None:
    a = build_manifest(sections())
    b = build_manifest(sections(update={"betas": [0.9]}))
    assert diff_manifests(a, b) == ["update.betas"]


def test_manifest_equality_follows_digest() -> None:
    assert isinstance(build_manifest(sections()), Manifest)
    assert build_manifest(sections()) == build_manifest(sections())
    assert build_manifest(sections()) != build_manifest(sections(seeds={"seed": 1}))
