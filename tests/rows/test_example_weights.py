"""L3 weights in the data: parsed and validated per text line and per conversation,
carried by examples into batches, covered by the data fingerprint, exact on resume,
and required (never defaulted to 1) by the weighted reductions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from exactstep.config import load_config
from exactstep.data.chat import load_chat_jsonl
from exactstep.data.conversation import write_chat_jsonl
from exactstep.data.corpus import corpus_fingerprint
from exactstep.data.documents import Document, read_jsonl
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError, DataError, ExactstepError
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import DataBundle, encode_documents, require_weights
from exactstep.rows.stream import RowStream
from exactstep.state.compare import state_differences

TOK = ByteTokenizer()
BAD_WEIGHTS = ["-1", '"2"', "true", "null", "NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400]


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


# ------------------------------------------------------------------------ parsing


def test_text_weights_are_read_and_absent_ones_stay_none(tmp_path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [
        '{"text": "a", "weight": 2}', '{"text": "b"}', '{"text": "c", "weight": 0.25}',
        '{"text": "d", "weight": 0}',
    ])
    docs = read_jsonl(path)
    assert [d.weight for d in docs] == [2.0, None, 0.25, 0.0]
    assert all(isinstance(d.weight, float) for d in docs if d.weight is not None)


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_bad_text_weight_is_a_data_error_naming_file_and_line(tmp_path, bad) -> None:
    path = write_lines(tmp_path / "t.jsonl", ['{"text": "ok"}', "", f'{{"text": "x", "weight": {bad}}}'])
    with pytest.raises(DataError, match=rf'{path}:3: "weight" must be a finite number >= 0'):
        read_jsonl(path)


def conversation_line(weight: str | None) -> str:
    messages = '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'
    extra = "" if weight is None else f', "weight": {weight}'
    return f'{{"messages": {messages}{extra}}}'


def test_chat_weights_are_read_and_round_trip(tmp_path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [conversation_line("1.5"), conversation_line(None)])
    conversations = load_chat_jsonl(path)
    assert [c.weight for c in conversations] == [1.5, None]
    again = load_chat_jsonl(write_chat_jsonl(conversations, tmp_path / "again.jsonl"))
    assert [c.weight for c in again] == [1.5, None]
    assert [c.to_json() for c in again] == [c.to_json() for c in conversations]


@pytest.mark.parametrize("bad", BAD_WEIGHTS)
def test_bad_chat_weight_is_a_data_error_naming_file_and_line(tmp_path, bad) -> None:
    path = write_lines(tmp_path / "c.jsonl", [conversation_line(None), conversation_line(bad)])
    with pytest.raises(DataError, match=rf'{path}:2: "weight" must be a finite number >= 0'):
        load_chat_jsonl(path)


# ------------------------------------------------------------- examples and batches


def test_chat_weight_reaches_every_supervised_row(tmp_path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [conversation_line("0.5"), conversation_line("3")])
    examples, _ = chat_examples(load_chat_jsonl(path), TOK, ChatPolicy(), max_len=64)
    assert [e.weight for e in examples] == [0.5, 3.0]
    batch = next(iter(RowStream(examples, BatchConfig(seq_len=64, rows=2), pad_id=TOK.pad_id,
                                seed=0)))
    for r, row in enumerate(batch.segments):
        for seg in row:
            supervised = batch.labels[r, seg.start:seg.stop] != -100
            assert supervised.any()
            want = examples[seg.example_id].weight
            assert torch.all(batch.weights[r, seg.start:seg.stop][supervised] == want)


def test_unweighted_examples_give_batches_without_weights() -> None:
    examples = encode_documents([Document("a", "hello"), Document("b", "world")], TOK)
    batch = next(iter(RowStream(examples, BatchConfig(seq_len=16, rows=1), pad_id=TOK.pad_id,
                                seed=0)))
    assert batch.weights is None


def weighted_examples(n: int = 30):
    docs = [Document(f"d{i}", "x" * (3 + (i * 7) % 29), weight=(i % 5) / 4) for i in range(n)]
    return encode_documents(docs, TOK)


def test_resume_is_exact_with_weights_and_the_cursor_is_unchanged_s2() -> None:
    """Weights live in the examples: the stream state has the same fields with or
    without them, and a resumed stream yields bitwise the same weights."""
    cfg = BatchConfig(seq_len=24, rows=2, buffer=4)
    examples = weighted_examples()
    straight = RowStream(examples, cfg, pad_id=TOK.pad_id, seed=7)
    head = [straight.next_batch() for _ in range(5)]
    state = json.loads(json.dumps(straight.state_dict()))
    tail = [straight.next_batch() for _ in range(6)]
    resumed = RowStream(examples, cfg, pad_id=TOK.pad_id, seed=7)
    resumed.load_state_dict(state)
    again = [resumed.next_batch() for _ in range(6)]
    for a, b in zip(tail, again, strict=True):
        assert state_differences([a.input_ids, a.labels, a.weights], [b.input_ids, b.labels,
                                 b.weights]) == []
    assert all(b.weights is not None for b in head + tail)
    unweighted = encode_documents([Document("a", "x"), Document("b", "y")], TOK)
    plain = RowStream(unweighted, cfg, pad_id=TOK.pad_id, seed=7).state_dict()
    assert _keys(plain) == _keys(state)


def _keys(tree) -> set[str]:
    if isinstance(tree, dict):
        return {f"{k}.{sub}" for k, v in tree.items() for sub in _keys(v)} | set(tree)
    return set()


# ---------------------------------------------------------------------- fingerprint


def test_fingerprint_covers_weights_and_keeps_unweighted_corpora_stable() -> None:
    train = (Document("a", "hello"), Document("b", "world"))
    val = (Document("c", "!"),)
    # the documented layout of an unweighted corpus, computed independently
    h = hashlib.sha256()
    for tag, docs in ((b"train", train), (b"val", val)):
        h.update(tag + len(docs).to_bytes(8, "big"))
        for doc in docs:
            for field in (doc.name.encode(), doc.text.encode()):
                h.update(len(field).to_bytes(8, "big") + field)
    assert corpus_fingerprint(train, val) == h.hexdigest()
    weighted = (Document("a", "hello", 1.0), Document("b", "world", 2.0))
    reweighted = (Document("a", "hello", 1.0), Document("b", "world", 2.5))
    prints = {corpus_fingerprint(t, val) for t in (train, weighted, reweighted)}
    assert len(prints) == 3


# -------------------------------------------------- weighted reductions need weights


@pytest.mark.parametrize("reduction", ["weighted", "weighted_count"])
def test_weighted_reduction_refuses_examples_without_weights_l3(reduction) -> None:
    unweighted = encode_documents([Document("a", "hello"), Document("b", "world")], TOK)
    with pytest.raises(ConfigError, match=rf"objective.reduction = '{reduction}' needs a "
                       r'numeric "weight" field.*2 of 2.*first: example 0'):
        require_weights(unweighted, reduction, source="stdlib")
    mixed = encode_documents([Document("a", "hello", 1.0), Document("b", "world")], TOK)
    with pytest.raises(ConfigError, match=r"1 of 2 .*first: example 1"):
        DataBundle(mixed, [], {"source": "jsonl:x"}, {}).require_weights(reduction)
    require_weights(weighted_examples(), reduction, source="jsonl:x")  # all weighted: fine


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "microbatch_mean"])
def test_other_reductions_need_no_weights(reduction) -> None:
    require_weights(encode_documents([Document("a", "hello")], TOK), reduction, source="stdlib")


def test_built_in_sources_carry_no_weights_l3() -> None:
    """The stdlib corpus and the arith demo have no weight fields: refused, not weight 1."""
    from exactstep.rows.sources import load_bundle

    for overrides in (["data.max_docs=40", "data.val_fraction=0.5"],
                      ["data.kind=chat", "data.source=arith", "arith.n_train=20"]):
        cfg = load_config(overrides=[*overrides, "objective.reduction=weighted"])
        with pytest.raises(ConfigError, match=r"objective.reduction = 'weighted'.*\"weight\""):
            load_bundle(cfg, TOK)  # the bundle is refused as it loads
        plain = load_bundle(load_config(overrides=overrides), TOK)
        assert all(e.weight is None for e in plain.train)


# ------------------------------------------------------------------- through train()


def write_docs(path: Path, weighted: bool) -> Path:
    lines = []
    for i in range(40):
        record = {"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * (1 + i % 3)}
        if weighted:
            record["weight"] = (1 + i % 4) / 2
        lines.append(json.dumps(record))
    return write_lines(path, lines)


def tiny_config(data: Path, reduction: str):
    return load_config(overrides=[
        f"data.source={data}", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "model.d_ff=32", "batch.rows=2", "batch.seq_len=48", "train.steps=3",
        "train.eval_tokens=200", "update.warmup=1", "checkpoint.every=0",
        "train.device=cpu", f"objective.reduction={reduction}",
    ])


@pytest.mark.parametrize("reduction", ["weighted", "weighted_count"])
def test_weighted_run_trains_on_the_data_weights_l3(tmp_path, reduction) -> None:
    from exactstep.run.runner import train

    out = tmp_path / "run"
    train(tiny_config(write_docs(tmp_path / "w.jsonl", True), reduction), out, progress=False)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    assert [r["disposition"] for r in ledger] == ["COMMITTED"] * 3
    if reduction == "weighted":  # D is the weight mass, not the token count
        assert any(r["D"] != r["tokens"] for r in ledger)
    else:
        assert all(r["D"] == r["tokens"] for r in ledger)


def test_weighted_run_without_weight_fields_takes_no_step_l3(tmp_path) -> None:
    from exactstep.run.runner import train

    out = tmp_path / "run"
    with pytest.raises(ExactstepError, match=r"objective.reduction = 'weighted'.*\"weight\""):
        train(tiny_config(write_docs(tmp_path / "u.jsonl", False), "weighted"), out,
              progress=False)
    ledger = out / "ledger.jsonl"
    assert not ledger.exists() or ledger.read_text() == ""


def test_weighted_run_without_weights_is_refused_before_the_manifest_l3(tmp_path) -> None:
    from exactstep.run.runner import train

    out = tmp_path / "run"
    with pytest.raises(ConfigError):
        train(tiny_config(write_docs(tmp_path / "u.jsonl", False), "weighted"), out,
              progress=False)
    assert not (out / "manifest.json").exists()


def test_weighted_run_resumes_exactly_and_refuses_changed_weights_s4_l3(tmp_path) -> None:
    """Train 4 windows (checkpoint at 2); resume a copy from window 2: same final weights,
    optimizer, RNG, cursor and ledger. Changing one weight in the data changes the
    fingerprint, so resuming over it is refused rather than continued."""
    import shutil

    from exactstep.errors import ResumeError
    from exactstep.run.continuation import resume
    from exactstep.run.runner import train
    from exactstep.state import latest_checkpoint, load_checkpoint

    data = write_docs(tmp_path / "w.jsonl", True)
    cfg = load_config(overrides=[
        f"data.source={data}", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "model.d_ff=32", "batch.rows=2", "batch.seq_len=48", "train.steps=4",
        "train.eval_tokens=200", "update.warmup=1", "checkpoint.every=2",
        "checkpoint.keep=5", "train.device=cpu", "objective.reduction=weighted",
    ])
    straight = tmp_path / "straight"
    train(cfg, straight, progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(straight, copy)
    resume(copy, from_checkpoint=copy / "checkpoints" / "window-00000002", progress=False)
    a = load_checkpoint(latest_checkpoint(straight / "checkpoints"))
    b = load_checkpoint(latest_checkpoint(copy / "checkpoints"))
    assert state_differences(a, b) == []
    assert (straight / "ledger.jsonl").read_bytes() == (copy / "ledger.jsonl").read_bytes()

    lines = data.read_text().splitlines()
    record = json.loads(lines[0])
    record["weight"] += 1.0
    data.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")
    with pytest.raises(ResumeError, match="data.fingerprint"):
        resume(copy, from_checkpoint=copy / "checkpoints" / "window-00000002", progress=False)
