"""Parquet, Arrow and shard-directory sources read through ``datasets`` (issue 12 item 5).

The same declared rows are written in every layout by the test itself (``pyarrow``,
``datasets``, plain JSON lines) and must come back as the same documents, in the
declared order, encoding to the token arrays ``BOS + UTF-8 bytes + EOS`` written out
here (S1). Names follow the documented ``<shard>#<row>`` / ``<shard>:<line>`` rule; the
split and fingerprint are recomputed from their documented definitions and stay the
same when the directory moves (S1, S5). Loading is offline, quiet, and leaves no cache
behind, with negative controls showing what the library does left to itself.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from run_support import tokens_of

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from exactstep.data.chat import load_chat_jsonl  # noqa: E402
from exactstep.data.config import DataConfig  # noqa: E402
from exactstep.data.conversation import Message  # noqa: E402
from exactstep.data.corpus import load_corpus, read_source  # noqa: E402
from exactstep.data.tokenizer import ByteTokenizer  # noqa: E402
from exactstep.errors import DataError  # noqa: E402
from exactstep.rows.example import encode_documents  # noqa: E402
from exactstep.rows.sources import conversations_digest  # noqa: E402

TEXTS = ["first document", "caf\u00e9 \u2615 two\nlines", "", "a third, longer document " * 3,
         "\U0001f600 emoji", "six", "seven and last"]
WEIGHTS = [1.0, 0.5, None, 2.0, 0.0, 3.0, 1.0]
ROWS = [{"body": t, "weight": w, "other": i} for i, (t, w) in enumerate(zip(TEXTS, WEIGHTS, strict=True))]
SHARDS = ((0, 3), (3, 5), (5, 7))  # rows of each of three shards


def jsonl_rows(rows: list[dict]) -> str:
    """JSON lines; a null weight is an absent key, as a JSONL author writes it."""
    return "".join(json.dumps({k: v for k, v in r.items() if v is not None},
                              ensure_ascii=False) + "\n" for r in rows)


def write_layout(root: Path, layout: str) -> tuple[Path, list[str]]:
    """``ROWS`` written as ``layout``: (data.source, the documented names in order)."""
    root.mkdir(parents=True, exist_ok=True)
    if layout == "jsonl-file":
        (root / "d.jsonl").write_text(jsonl_rows(ROWS), encoding="utf-8")
        return root / "d.jsonl", [f"d.jsonl:{i + 1}" for i in range(7)]
    if layout == "parquet-file":
        pq.write_table(pa.Table.from_pylist(ROWS), root / "d.parquet")
        return root / "d.parquet", [f"d.parquet#{i}" for i in range(7)]
    if layout == "parquet-shards":  # written last shard first, in nested directories
        for k, (a, b) in reversed(list(enumerate(SHARDS))):
            (root / "data" / f"g{k // 2}").mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(ROWS[a:b]),
                           root / "data" / f"g{k // 2}" / f"train-{k:05d}.parquet")
        (root / "README.md").write_text("# a dataset card\n")
        names = [f"data/g{k // 2}/train-{k:05d}.parquet#{r}"
                 for k, (a, b) in enumerate(SHARDS) for r in range(b - a)]
        return root, names
    if layout == "arrow-saved":  # datasets' own save_to_disk: 2 shards + metadata json
        datasets.Dataset.from_list(ROWS).save_to_disk(str(root / "saved"), num_shards=2)
        names = [f"data-00000-of-00002.arrow#{r}" for r in range(4)]
        return root / "saved", names + [f"data-00001-of-00002.arrow#{r}" for r in range(3)]
    if layout == "arrow-ipc-file":  # pyarrow's random-access IPC file format
        table = pa.Table.from_pylist(ROWS)
        with pa.OSFile(str(root / "d.arrow"), "wb") as sink, \
                pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        return root / "d.arrow", [f"d.arrow#{i}" for i in range(7)]
    if layout == "jsonl-shards":
        for k, (a, b) in enumerate(SHARDS):
            (root / f"part-{k}.jsonl").write_text(jsonl_rows(ROWS[a:b]), encoding="utf-8")
        return root, [f"part-{k}.jsonl:{r + 1}" for k, (a, b) in enumerate(SHARDS)
                      for r in range(b - a)]
    raise AssertionError(layout)


FORMAT_OF = {"jsonl-file": "jsonl", "parquet-file": "parquet", "parquet-shards": "parquet",
             "arrow-saved": "arrow", "arrow-ipc-file": "arrow", "jsonl-shards": "jsonl"}
LAYOUTS = list(FORMAT_OF)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_gives_the_declared_documents_in_order(tmp_path: Path, layout) -> None:
    source, names = write_layout(tmp_path, layout)
    fmt, docs = read_source(source, "body")
    assert fmt == FORMAT_OF[layout]
    assert [d.name for d in docs] == names
    assert [d.text for d in docs] == TEXTS
    assert [d.weight for d in docs] == WEIGHTS
    examples = encode_documents(docs, ByteTokenizer())
    assert [e.tokens.tolist() for e in examples] == [tokens_of(t) for t in TEXTS]


def test_jsonl_and_parquet_give_the_same_examples_in_the_same_order(tmp_path: Path) -> None:
    """The comparison the issue asks for, directly: one set of rows, two formats."""
    _, from_jsonl = read_source(write_layout(tmp_path / "j", "jsonl-file")[0], "body")
    _, from_parquet = read_source(write_layout(tmp_path / "p", "parquet-shards")[0], "body")
    tok = ByteTokenizer()
    pairs = zip(encode_documents(from_jsonl, tok), encode_documents(from_parquet, tok),
                strict=True)
    assert all(a.tokens.tolist() == b.tokens.tolist() and a.weight == b.weight
               for a, b in pairs)


# --------------------------------------------------------------------------- split, fingerprint


def documented_fingerprint(train, val) -> str:
    """The fingerprint as ``data.corpus`` documents it, written out independently."""
    h = hashlib.sha256()
    for tag, docs in ((b"train", train), (b"val", val)):
        h.update(tag + len(docs).to_bytes(8, "big"))
        for doc in docs:
            for field in (doc.name.encode(), doc.text.encode()):
                h.update(len(field).to_bytes(8, "big") + field)
    h.update(b"weights")
    for doc in train + val:
        field = b"" if doc.weight is None else repr(doc.weight).encode()
        h.update(len(field).to_bytes(8, "big") + field)
    return h.hexdigest()


def is_val(name: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64 < fraction


def many_rows(n: int = 60) -> list[dict]:
    return [{"text": f"row {i} " * (1 + i % 4), "weight": float(i % 3)} for i in range(n)]


def write_parquet_shards(root: Path, rows: list[dict], n_shards: int = 3) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    step = -(-len(rows) // n_shards)
    for k in range(n_shards):
        pq.write_table(pa.Table.from_pylist(rows[k * step:(k + 1) * step]),
                       root / f"shard-{k}.parquet")
    return root


def test_split_and_fingerprint_follow_the_documented_rules(tmp_path: Path) -> None:
    rows = many_rows()
    source = write_parquet_shards(tmp_path / "d", rows)
    corpus = load_corpus(DataConfig(source=str(source), val_fraction=0.2))
    assert corpus.source == f"parquet:{source}"
    names = [f"shard-{k}.parquet#{r}" for k in range(3) for r in range(20)]
    assert [d.name for d in corpus.train] == [n for n in names if not is_val(n, 0.2)]
    assert [d.name for d in corpus.val] == [n for n in names if is_val(n, 0.2)]
    assert corpus.fingerprint == documented_fingerprint(corpus.train, corpus.val)


def test_moving_the_directory_keeps_names_split_and_fingerprint_s5(tmp_path: Path) -> None:
    """Names are relative to the source, so another machine's path changes nothing."""
    source = write_parquet_shards(tmp_path / "here", many_rows())
    moved = shutil.copytree(source, tmp_path / "else" / "where")
    a = load_corpus(DataConfig(source=str(source), val_fraction=0.2))
    b = load_corpus(DataConfig(source=str(moved), val_fraction=0.2))
    assert (a.train, a.val, a.fingerprint) == (b.train, b.val, b.fingerprint)


@pytest.mark.parametrize("change", ["text", "weight", "nothing"])
def test_the_fingerprint_changes_when_one_row_changes(tmp_path: Path, change: str) -> None:
    """One row of the last shard changed (its text, or only its weight) changes the
    fingerprint; rewriting the same rows (the control) keeps it."""
    rows = many_rows()
    source = write_parquet_shards(tmp_path / "d", rows)
    before = load_corpus(DataConfig(source=str(source), val_fraction=0.2)).fingerprint
    edited = [dict(r) for r in rows]
    if change == "text":
        edited[57]["text"] += "!"
    elif change == "weight":
        edited[57]["weight"] += 1.0
    write_parquet_shards(source, edited)
    after = load_corpus(DataConfig(source=str(source), val_fraction=0.2)).fingerprint
    assert (after != before) == (change != "nothing")


# --------------------------------------------------------------------------- chat

USER = {"role": "user", "content": "2+2?"}
CALL_F = {"role": "assistant", "content": None,
          "tool_calls": [{"name": "f", "arguments": {"x": 1}}]}
CALL_G = {"role": "assistant", "content": "calling",
          "tool_calls": [{"name": "g", "arguments": {"y": "a"}}]}
TOOL = {"role": "tool", "content": "4"}
ANSWER = {"role": "assistant", "content": "4"}
SYSTEM = {"role": "system", "content": "be brief"}
CHATS = [
    {"messages": [USER, CALL_F, TOOL, ANSWER], "weight": 1.0},
    {"messages": [SYSTEM, USER, CALL_G], "weight": 0.5},
    {"messages": [USER, ANSWER], "weight": 2.0},
]
EXPECTED = [  # the declared conversations, as data.chat documents their values
    (Message("user", "2+2?"), Message("assistant", "", ('{"arguments":{"x":1},"name":"f"}',)),
     Message("tool", "4"), Message("assistant", "4")),
    (Message("system", "be brief"), Message("user", "2+2?"),
     Message("assistant", "calling", ('{"arguments":{"y":"a"},"name":"g"}',))),
    (Message("user", "2+2?"), Message("assistant", "4")),
]


def test_chat_parquet_arrow_and_jsonl_give_the_same_conversations(tmp_path: Path) -> None:
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps(c) + "\n" for c in CHATS))
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "c.parquet")
    datasets.Dataset.from_list(CHATS).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "shards").mkdir()
    for k, chat in enumerate(CHATS):
        (tmp_path / "shards" / f"{k}.jsonl").write_text(json.dumps(chat) + "\n")
    for source in (jsonl, tmp_path / "c.parquet", tmp_path / "saved", tmp_path / "shards"):
        loaded = load_chat_jsonl(source)
        assert [c.messages for c in loaded] == EXPECTED, source
        assert [c.weight for c in loaded] == [1.0, 0.5, 2.0], source
    assert conversations_digest(load_chat_jsonl(tmp_path / "c.parquet")) == \
        conversations_digest(load_chat_jsonl(jsonl))


def test_negative_control_arrow_really_stores_the_absent_fields_as_nulls(tmp_path) -> None:
    """The comparison above exercises the null dropping: the table itself holds
    ``content: None`` and ``arguments.y: None`` for the fields the JSON lacks."""
    table = pa.Table.from_pylist(CHATS)
    first = table.column("messages").to_pylist()[0]
    assert first[1]["content"] is None
    assert first[1]["tool_calls"][0]["arguments"] == {"x": 1, "y": None}
    assert first[0]["tool_calls"] is None


def test_a_changed_chat_row_changes_the_digest(tmp_path: Path) -> None:
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "a.parquet")
    edited = json.loads(json.dumps(CHATS))
    edited[2]["messages"][1]["content"] = "5"
    pq.write_table(pa.Table.from_pylist(edited), tmp_path / "b.parquet")
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "same.parquet")
    digest = {p: conversations_digest(load_chat_jsonl(tmp_path / p))
              for p in ("a.parquet", "b.parquet", "same.parquet")}
    assert digest["a.parquet"] != digest["b.parquet"]
    assert digest["a.parquet"] == digest["same.parquet"]


def test_messages_field_names_the_column_or_key(tmp_path: Path) -> None:
    renamed = [{"conversation": c["messages"]} for c in CHATS]
    pq.write_table(pa.Table.from_pylist(renamed), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    for path in (tmp_path / "c.parquet", tmp_path / "c.jsonl"):
        loaded = load_chat_jsonl(path, messages_field="conversation")
        assert [c.messages for c in loaded] == EXPECTED
    with pytest.raises(DataError) as info:
        load_chat_jsonl(tmp_path / "c.parquet")
    assert str(info.value) == (f"data.messages_field 'messages' is not a column of "
                               f"{tmp_path / 'c.parquet'}; columns: conversation")


def test_chat_rows_are_validated_as_chat_jsonl_lines(tmp_path: Path) -> None:
    bad = [CHATS[0], {"messages": [USER, {"role": "bot", "content": "4"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "c.parquet")
    with pytest.raises(DataError) as info:
        load_chat_jsonl(tmp_path / "c.parquet")
    assert str(info.value).startswith(f"{tmp_path / 'c.parquet'} row 1: message 1 has "
                                      "unknown role 'bot'")


# --------------------------------------------------------------------------- errors


def table_file(path: Path, columns: dict) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_text_column_errors_name_the_file_row_and_field(tmp_path: Path) -> None:
    texts = table_file(tmp_path / "t.parquet", {"text": ["a", None], "n": [1, 2]})
    with pytest.raises(DataError) as info:
        read_source(texts, "body")
    assert str(info.value) == f"data.text_field 'body' is not a column of {texts}; columns: text, n"
    with pytest.raises(DataError, match=f"^data.text_field 'n' of {texts} is a column of int64"):
        read_source(texts, "n")
    with pytest.raises(DataError, match=f"^{texts} row 1: data.text_field 'text' is null"):
        read_source(texts, "text")
    weights = table_file(tmp_path / "w.parquet", {"text": ["a", "b"], "weight": [1.0, -1.0]})
    with pytest.raises(DataError, match=f'^{weights} row 1: "weight" must be a finite number'):
        read_source(weights, "text")


def test_text_that_is_not_utf8_is_refused_naming_the_row(tmp_path: Path) -> None:
    """Parquet does not check UTF-8: the bytes reach the reader, which refuses them."""
    raw = b"ok" + b"caf\xe9"
    offsets = pa.array([0, 2, 6], type=pa.int32()).buffers()[1]
    column = pa.StringArray.from_buffers(2, offsets, pa.py_buffer(raw))
    path = table_file(tmp_path / "latin1.parquet", {"text": column})
    with pytest.raises(DataError, match=f"^{path} row 1: column 'text' holds text that is "
                                        "not valid UTF-8"):
        read_source(path, "text")


def test_directories_and_files_that_are_not_one_format_are_refused(tmp_path: Path) -> None:
    shards = write_parquet_shards(tmp_path / "d", many_rows(), n_shards=2)
    (shards / "extra.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"mixes shard formats \(1 \.jsonl \(extra\.jsonl\), "
                                        r"2 \.parquet \(shard-0\.parquet\)\)"):
        read_source(shards)
    (shards / "extra.jsonl").unlink()
    (shards / ".hidden.csv").write_text("passed over\n")
    (shards / "_SUCCESS").write_text("")
    assert len(read_source(shards)[1]) == 60  # hidden and marker files are passed over
    (shards / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="holds notes.csv, which is not a .jsonl, .parquet"):
        read_source(shards)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is a directory with no .jsonl, .parquet or .arrow"):
        read_source(tmp_path / "empty")
    with pytest.raises(DataError, match="nope.parquet does not exist"):
        read_source(tmp_path / "nope.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken.parquet cannot be read as \.parquet \("):
        read_source(tmp_path / "broken.parquet")


def test_empty_shards_are_skipped_and_an_empty_source_refused(tmp_path: Path) -> None:
    """The library itself fails on a Parquet or Arrow file with no rows; such a shard
    holds no example and is passed, while a source with no row at all is refused."""
    empty = pa.table({"text": pa.array([], pa.string())})
    (tmp_path / "d").mkdir()
    pq.write_table(empty, tmp_path / "d" / "a.parquet")
    pq.write_table(pa.table({"text": ["one", "two"]}), tmp_path / "d" / "b.parquet")
    assert [d.name for d in read_source(tmp_path / "d")[1]] == ["b.parquet#0", "b.parquet#1"]
    (tmp_path / "d" / "b.parquet").unlink()
    with pytest.raises(DataError, match=r"holds no rows \(1 \.parquet file\)"):
        read_source(tmp_path / "d")
    with pa.OSFile(str(tmp_path / "e.arrow"), "wb") as sink, \
            pa.ipc.new_stream(sink, empty.schema) as writer:
        writer.write_table(empty)
    with pytest.raises(DataError, match="holds no rows"):
        load_chat_jsonl(tmp_path / "e.arrow")


def test_file_names_with_glob_characters_are_read_as_they_are(tmp_path: Path) -> None:
    """``a[1].parquet`` is that file, not the pattern matching ``a1.parquet``."""
    pq.write_table(pa.table({"text": ["bracketed"]}), tmp_path / "a[1].parquet")
    pq.write_table(pa.table({"text": ["matched by the pattern"]}), tmp_path / "a1.parquet")
    assert [d.text for d in read_source(tmp_path / "a[1].parquet")[1]] == ["bracketed"]
    assert [d.name for d in read_source(tmp_path)[1]] == ["a1.parquet#0", "a[1].parquet#0"]


def test_a_bad_line_in_a_jsonl_shard_is_named_by_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "ok"}\n\n{"text": \n')
    with pytest.raises(DataError, match=f"^{tmp_path / 'b.jsonl'}:3: not valid JSON"):
        read_source(tmp_path)


# --------------------------------------------------------------------------- offline, quiet


@pytest.fixture
def watched(tmp_path: Path, monkeypatch):
    """Network attempts recorded (and refused), the library's default cache and the
    temporary directory moved under ``tmp_path`` where the test can look at them."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args[:2])
        raise OSError("the network is not reachable from this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    return attempts


def test_loading_is_offline_quiet_and_leaves_no_cache(tmp_path, watched, capfd) -> None:
    source = write_parquet_shards(tmp_path / "d", many_rows(), n_shards=2)
    settings = (datasets.config.HF_HUB_OFFLINE, datasets.are_progress_bars_disabled())
    capfd.readouterr()
    assert len(read_source(source)[1]) == 60
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert watched == []
    assert not (tmp_path / "hf-cache").exists()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert (datasets.config.HF_HUB_OFFLINE, datasets.are_progress_bars_disabled()) == settings


def test_negative_control_the_library_left_to_itself(tmp_path, watched, capfd, monkeypatch):
    """The same file loaded by ``datasets`` directly, online and with its defaults:
    it tries the network, prints progress bars and caches under its own directory."""
    source = write_parquet_shards(tmp_path / "d", many_rows(), n_shards=1)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    was_off = datasets.are_progress_bars_disabled()
    datasets.enable_progress_bars()
    try:
        capfd.readouterr()
        datasets.load_dataset("parquet", data_files=[str(source / "shard-0.parquet")],
                              split="train")
        err = capfd.readouterr().err
    finally:
        if was_off:
            datasets.disable_progress_bars()
    assert watched != []
    assert "Generating train split" in err
    assert any((tmp_path / "hf-cache").iterdir())
