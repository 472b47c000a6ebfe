"""Declared further columns (``data.columns``) from JSONL and Parquet, text and chat (S1, X4).

Each example carries the values of the declared columns of its own line or row, in the
declared order, whatever the format; the data fingerprint covers them (a changed
answer is a different run; negative control: undeclared, the same change leaves the
fingerprint as it was). A declared column a line or table lacks is one ``DataError``
naming the line (JSONL) or the table's columns (Parquet).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from exactstep.data.chat import load_chat_jsonl  # noqa: E402
from exactstep.data.config import DataConfig  # noqa: E402
from exactstep.data.corpus import load_corpus  # noqa: E402
from exactstep.data.tokenizer import ByteTokenizer  # noqa: E402
from exactstep.errors import DataError  # noqa: E402
from exactstep.rows.chat import ChatPolicy, chat_examples  # noqa: E402
from exactstep.rows.example import encode_documents  # noqa: E402
from exactstep.rows.sources import conversations_digest  # noqa: E402

CHATS = [{"messages": [{"role": "user", "content": f"q{i}"},
                       {"role": "assistant", "content": f"a{i}"}],
          "answer": f"{i * 3}", "id": i, "other": "x"} for i in range(12)]


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_each_conversation_carries_its_own_declared_columns(tmp_path, suffix):
    path = write(tmp_path / f"c{suffix}", CHATS)
    conversations = load_chat_jsonl(path, columns=("id", "answer"))
    assert [c.columns for c in conversations] == [{"id": r["id"], "answer": r["answer"]}
                                                  for r in CHATS]
    assert list(conversations[0].columns) == ["id", "answer"]  # the declared order
    examples, _ = chat_examples(conversations, ByteTokenizer(), ChatPolicy(), max_len=64)
    assert [e.columns["answer"] for e in examples] == [r["answer"] for r in CHATS]
    assert all(c.columns is None for c in load_chat_jsonl(path))  # undeclared: none


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_each_document_carries_its_own_declared_columns(tmp_path, suffix):
    rows = [{"text": f"doc {i} " * 3, "answer": str(i)} for i in range(40)]
    path = write(tmp_path / f"t{suffix}", rows)
    corpus = load_corpus(DataConfig(source=str(path), kind="text", columns=("answer",),
                                    val_fraction=0.25))
    by_text = {r["text"]: r["answer"] for r in rows}
    examples = encode_documents(list(corpus.train), ByteTokenizer())
    assert [e.columns for e in examples] == [{"answer": by_text[d.text]} for d in corpus.train]


def test_the_fingerprint_covers_declared_columns_only(tmp_path):
    path = write(tmp_path / "c.jsonl", CHATS)
    changed = write(tmp_path / "d.jsonl", [{**r, "answer": "0"} if r["id"] == 3 else r
                                           for r in CHATS])
    declared = [conversations_digest(load_chat_jsonl(p, columns=("answer",)))
                for p in (path, changed)]
    assert declared[0] != declared[1]
    undeclared = [conversations_digest(load_chat_jsonl(p)) for p in (path, changed)]
    assert undeclared[0] == undeclared[1]  # negative control: nothing declared, nothing seen
    text = [{"text": f"doc {i}", "answer": str(i)} for i in range(40)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # the same file name: documents are named by it
    a, b = write(tmp_path / "a/t.jsonl", text), write(tmp_path / "b/t.jsonl",
                                                      [{**t, "answer": "9"} for t in text])
    prints = [load_corpus(DataConfig(source=str(p), kind="text", columns=("answer",),
                                     val_fraction=0.25)
                          ).fingerprint for p in (a, b)]
    assert prints[0] != prints[1]
    plain = [load_corpus(DataConfig(source=str(p), kind="text",
                                        val_fraction=0.25)).fingerprint for p in (a, b)]
    assert plain[0] == plain[1]


def test_a_missing_declared_column_is_one_data_error(tmp_path):
    rows = [dict(r) for r in CHATS]
    del rows[4]["answer"]
    with pytest.raises(DataError, match=r'c.jsonl:5: no "answer" field, which data.columns'):
        load_chat_jsonl(write(tmp_path / "c.jsonl", rows), columns=("answer",))
    with pytest.raises(DataError, match=r"data.columns entry 'solution' is not a column of "
                                        r".*columns: messages, answer, id, other"):
        load_chat_jsonl(write(tmp_path / "c.parquet", CHATS), columns=("solution",))
