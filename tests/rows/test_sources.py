"""A run's data sources: splits, manifest sections, held-out conversations (R5, S1)."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from exactstep.config import RunConfig
from exactstep.data.arith import ArithSpec
from exactstep.data.chat import DEFAULT_TEMPLATE, load_chat_jsonl
from exactstep.data.config import DataConfig
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError, MissingSectionError
from exactstep.rows.chat import ChatPolicy
from exactstep.rows.config import BatchConfig, run_section
from exactstep.rows.sources import is_val, load_bundle

TOK = ByteTokenizer()


def run_config(source: str, **data) -> RunConfig:
    return RunConfig(data=DataConfig(source=source, kind="chat", **data), batch=BatchConfig(seq_len=160))


def test_arith_source_gives_train_examples_heldout_and_template_hash():
    data = load_bundle(run_config("arith", max_docs=30), TOK)
    assert len(data.train) == 30
    assert len(data.heldout_conversations) == len(data.val) > 0
    assert data.representation["template_hash"] == DEFAULT_TEMPLATE.fingerprint(TOK)
    assert data.section["chat_policy"] == {"turns": "all", "supervise_eot": True,
                                           "supervise_tool_calls": True, "empty": "drop"}
    assert data.section["chat_train"]["kept"] == 30
    again = load_bundle(run_config("arith", max_docs=30), TOK)
    assert again.section["fingerprint"] == data.section["fingerprint"]
    other_seed = load_bundle(RunConfig(seed=1, data=DataConfig(source="arith", kind="chat", max_docs=30)), TOK)
    assert other_seed.section["fingerprint"] != data.section["fingerprint"]


def write_lines(path, n: int) -> list[dict]:
    lines = [
        {"messages": [{"role": "user", "content": f"q{k}"}, {"role": "assistant", "content": f"a{k}"}]}
        for k in range(n)
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return lines


def content_bucket(line: dict) -> float:
    """The split rule spelled out: sha256 of the conversation's sorted-key JSON."""
    canonical = json.dumps(line, sort_keys=True, ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big") / 2**64


def test_jsonl_source_is_split_by_content_hash_without_heldout_scoring(tmp_path):
    path = tmp_path / "c.jsonl"
    lines = write_lines(path, 60)
    data = load_bundle(run_config(str(path), val_fraction=0.25), TOK)
    val = [line for line in lines if content_bucket(line) < 0.25]
    assert 0 < len(val) < 60
    assert [is_val(c, 0.25) for c in load_chat_jsonl(path)] == [
        content_bucket(line) < 0.25 for line in lines]
    assert (len(data.train), len(data.val)) == (60 - len(val), len(val))
    assert data.heldout_conversations is None
    # supervised targets: each answer's bytes and its end-of-turn marker
    train = [line for line in lines if content_bucket(line) >= 0.25]
    expected = sum(len(line["messages"][1]["content"].encode()) + 1 for line in train)
    assert data.section["chat_train"]["supervised_targets"] == expected


def test_jsonl_errors_and_empty_policy_surface_as_data_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        load_bundle(run_config(str(bad)), TOK)
    no_answer = tmp_path / "q.jsonl"
    no_answer.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"x{i}"}]})
                                 + "\n" for i in range(40)))
    cfg = SimpleNamespace(**{**vars(run_config(str(no_answer), val_fraction=0.3)),
                             "chat": ChatPolicy(empty="error")})
    with pytest.raises(DataError, match="no supervised token"):
        load_bundle(cfg, TOK)


def test_a_missing_section_is_a_typed_error_naming_the_key():
    """No default stands in for a section the configuration lacks: a chat run handed a
    configuration without ``chat`` (or with something else there) is refused with a
    ``MissingSectionError`` naming the key, before any data is read."""
    whole = run_config("arith", max_docs=30)
    assert run_section(whole, "chat", ChatPolicy) is whole.chat
    partial = SimpleNamespace(data=whole.data, batch=whole.batch, objective=whole.objective,
                              seed=0, arith=whole.arith)
    with pytest.raises(MissingSectionError, match=r"no \[chat\] section") as info:
        load_bundle(partial, TOK)
    assert info.value.key == "chat"
    with pytest.raises(MissingSectionError, match=r"no \[arith\] section"):
        run_section(SimpleNamespace(arith=ChatPolicy()), "arith", ArithSpec)
