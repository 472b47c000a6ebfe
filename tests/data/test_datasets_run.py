"""Runs end to end on Parquet data through ``exactstep.run.runner.train`` (issue 12 item 5).

A text run on a directory of Parquet shards and a chat run on a Parquet file, at the
tiny shapes of the CLI tests: every window commits, and the manifest records the
source, the split sizes the documented name-hash split gives, and the fingerprint
recomputed here from its documented definition (S1).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from run_support import short_texts

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from exactstep.config import load_config  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TINY = ["batch.seq_len=32", "batch.rows=2", "model.d_model=16", "model.n_layers=1",
        "model.n_heads=2", "model.d_ff=32", "train.steps=2", "train.eval_tokens=64",
        "update.warmup=1", "train.threads=1", "train.device=cpu", "checkpoint.every=0"]


def run(source: Path, out: Path, *extra: str) -> tuple[list[dict], dict]:
    from exactstep.run.runner import train

    train(load_config(overrides=[f"data.source={source}", *TINY, *extra]), out, progress=False)
    ledger = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    return ledger, json.loads((out / "manifest.json").read_text())


def data_section(manifest: dict) -> dict:
    return manifest["manifest"]["data"]


def is_val(name: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64 < fraction


def test_a_text_run_on_parquet_shards(tmp_path: Path) -> None:
    texts = short_texts(48)
    (tmp_path / "shards").mkdir()
    for k in range(3):
        pq.write_table(pa.table({"body": texts[16 * k:16 * (k + 1)]}),
                       tmp_path / "shards" / f"train-{k:05d}-of-00003.parquet")
    ledger, manifest = run(tmp_path / "shards", tmp_path / "run", "data.text_field=body",
                           "data.val_fraction=0.2")
    assert [r["disposition"] for r in ledger] == ["COMMITTED", "COMMITTED"]
    names = [f"train-{k:05d}-of-00003.parquet#{r}" for k in range(3) for r in range(16)]
    train = [(n, t) for n, t in zip(names, texts, strict=True) if not is_val(n, 0.2)]
    val = [(n, t) for n, t in zip(names, texts, strict=True) if is_val(n, 0.2)]
    h = hashlib.sha256()
    for tag, docs in ((b"train", train), (b"val", val)):
        h.update(tag + len(docs).to_bytes(8, "big"))
        for name, text in docs:
            for field in (name.encode(), text.encode()):
                h.update(len(field).to_bytes(8, "big") + field)
    section = data_section(manifest)
    assert section["source"] == f"parquet:{tmp_path / 'shards'}"
    assert (section["train_documents"], section["val_documents"]) == (len(train), len(val))
    assert section["fingerprint"] == h.hexdigest()


def conversations(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{k}+1?"},
                          {"role": "assistant", "content": f"{k + 1}"}]} for k in range(n)]


def test_a_chat_run_on_a_parquet_file(tmp_path: Path) -> None:
    chats = conversations(40)
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "chat.parquet")
    ledger, manifest = run(tmp_path / "chat.parquet", tmp_path / "run", "data.kind=chat",
                           "data.val_fraction=0.2")
    assert [r["disposition"] for r in ledger] == ["COMMITTED", "COMMITTED"]
    h = hashlib.sha256()  # the chat fingerprint: sorted-key JSON lines, train then val
    canonical = [json.dumps(c, sort_keys=True, ensure_ascii=False) for c in chats]
    bucket = [int.from_bytes(hashlib.sha256(c.encode()).digest()[:8], "big") / 2**64
              for c in canonical]
    ordered = ([c for c, b in zip(canonical, bucket, strict=True) if b >= 0.2]
               + [c for c, b in zip(canonical, bucket, strict=True) if b < 0.2])
    for line in ordered:
        h.update(line.encode() + b"\n")
    section = data_section(manifest)
    assert section["source"] == str(tmp_path / "chat.parquet")
    assert section["fingerprint"] == h.hexdigest()
    assert section["chat_train"]["kept"] + section["chat_val"]["kept"] == 40


def test_a_chat_run_reads_the_messages_field_it_is_given(tmp_path: Path) -> None:
    renamed = [{"conversation": c["messages"]} for c in conversations(40)]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "chat.parquet")
    ledger, _ = run(tmp_path / "chat.parquet", tmp_path / "run", "data.kind=chat",
                    "data.val_fraction=0.2", "data.messages_field=conversation")
    assert [r["disposition"] for r in ledger] == ["COMMITTED", "COMMITTED"]
