"""Corpora (issue 2 item 2): the stdlib corpus, JSONL files, the split and the
fingerprint (S1), and the DataErrors that name what to change (X4)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from exactstep.data.config import DataConfig
from exactstep.data.corpus import load_corpus, val_bucket
from exactstep.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def stdlib_corpus():
    return load_corpus(DataConfig())


def independent_fingerprint(corpus) -> str:
    h = hashlib.sha256()
    for tag, docs in ((b"train", corpus.train), (b"val", corpus.val)):
        h.update(tag + len(docs).to_bytes(8, "big"))
        for doc in docs:
            for field in (doc.name.encode(), doc.text.encode()):
                h.update(len(field).to_bytes(8, "big") + field)
    return h.hexdigest()


def test_stdlib_corpus_is_real_deterministic_and_skips_tests(stdlib_corpus) -> None:
    corpus = stdlib_corpus
    names = [d.name for d in corpus.train + corpus.val]
    assert len(names) > 100 and "os.py" in names and "json/__init__.py" in names
    for name in names:
        parts = name.split("/")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), name
        assert name.endswith(".py")
    assert [d.name for d in corpus.train] == sorted(d.name for d in corpus.train)
    assert all(d.text for d in corpus.train + corpus.val)
    again = load_corpus(DataConfig())
    assert again == corpus
    assert corpus.source.startswith("stdlib:python3.")


def test_split_is_by_name_hash(stdlib_corpus) -> None:
    corpus = stdlib_corpus
    assert all(val_bucket(d.name) < 0.05 for d in corpus.val)
    assert all(val_bucket(d.name) >= 0.05 for d in corpus.train)
    bucket = int.from_bytes(hashlib.sha256(b"os.py").digest()[:8], "big") / 2**64
    assert val_bucket("os.py") == bucket
    assert 0 < len(corpus.val) < len(corpus.train)


def test_fingerprint_covers_names_and_bytes(stdlib_corpus) -> None:
    assert stdlib_corpus.fingerprint == independent_fingerprint(stdlib_corpus)


def write_jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_corpus(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"document number {i}"}) for i in range(200)]
    lines.insert(3, "")  # blank lines are skipped
    lines.insert(5, json.dumps({"text": ""}))  # empty documents are skipped and counted
    source = write_jsonl(tmp_path / "d.jsonl", lines)
    corpus = load_corpus(DataConfig(source=source, val_fraction=0.1))
    assert len(corpus.train) + len(corpus.val) == 200
    assert corpus.skipped_empty == 1
    assert corpus.train[0].name == "d.jsonl:1"
    assert corpus.fingerprint == independent_fingerprint(corpus)
    capped = load_corpus(DataConfig(source=source, val_fraction=0.1, max_docs=50))
    assert len(capped.train) + len(capped.val) == 50


def test_fingerprint_changes_with_one_byte(tmp_path: Path) -> None:
    """Negative control for the fingerprint: one changed byte changes it."""
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(100)]
    a = load_corpus(DataConfig(source=write_jsonl(tmp_path / "a.jsonl", lines), val_fraction=0.2))
    lines[7] = json.dumps({"text": "doc 8"})
    b = load_corpus(DataConfig(source=write_jsonl(tmp_path / "a.jsonl", lines), val_fraction=0.2))
    assert a.fingerprint != b.fingerprint


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "ok"}', "{not json"], "bad.jsonl:2: not valid JSON"),
        (['{"text": "ok"}', '{"body": "x"}'], 'bad.jsonl:2: no "text" field'),
        (['{"text": 5}'], 'bad.jsonl:1: "text" must be a string, got a JSON number'),
        (['{"text": null}'], 'bad.jsonl:1: "text" must be a string, got a JSON null'),
        (['["text"]'], 'bad.jsonl:1: no "text" field .*a JSON array'),
        (['"just a string"'], 'bad.jsonl:1: no "text" field .*a JSON string'),
        (['{"text": "ok"}', '{"text": "a\\ud800b"}'], r"bad.jsonl:2: .*unpaired surrogate \(\\ud800"),
        (['{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"], "bad.jsonl:1: JSON nested too deeply"),
        (['{"text": ""}', ""], "no non-empty document"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, lines, message: str) -> None:
    source = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=message) as info:
        load_corpus(DataConfig(source=source))
    assert "bad.jsonl" in str(info.value)


def test_invalid_utf8_is_refused_naming_file_line_and_byte(tmp_path: Path) -> None:
    """S1: an undecodable byte is refused, never replaced (the replacement character
    would silently change the document and its fingerprint)."""
    path = tmp_path / "latin1.jsonl"
    good = json.dumps({"text": "fine"}).encode()
    path.write_bytes(good + b"\n" + good + b"\n" + '{"text": "caf\u00e9"}'.encode("latin-1") + b"\n")
    with pytest.raises(DataError) as info:
        load_corpus(DataConfig(source=str(path)))
    assert f"{path}:3: not valid UTF-8 (byte 0xe9 at column 14)" in str(info.value)


def test_negative_control_the_same_line_in_utf8_loads(tmp_path: Path) -> None:
    """The refusal above is about the encoding: the same text in UTF-8 (with a BOM,
    which is allowed and dropped) loads with its accent intact."""
    path = tmp_path / "utf8.jsonl"
    lines = [json.dumps({"text": f"caf\u00e9 {i}"}, ensure_ascii=False) for i in range(60)]
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode("utf-8") + b"\n")
    corpus = load_corpus(DataConfig(source=str(path), val_fraction=0.2))
    texts = sorted(d.text for d in corpus.train + corpus.val)
    assert texts == sorted(f"caf\u00e9 {i}" for i in range(60))


def test_a_directory_is_not_a_data_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="is a directory"):
        load_corpus(DataConfig(source=str(tmp_path)))


def test_missing_file_and_empty_splits(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "nope.jsonl")))
    one = write_jsonl(tmp_path / "one.jsonl", [json.dumps({"text": "only one"})])
    with pytest.raises(DataError, match="split .* is empty"):
        load_corpus(DataConfig(source=one))
    with pytest.raises(ConfigError, match="data.kind"):
        load_corpus(DataConfig(source=one, kind="chat"))
