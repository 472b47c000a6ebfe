"""``exactstep tokenizer train``: a byte-level BPE on the training split only (H2, S1).

Promises checked here, each against an expectation built independently of the
trainer: the files are byte-identical for the same corpus and vocabulary size (and
differ when the size changes: the comparison can fail); no validation document
reaches the trainer (a marker string found only in the validation documents gets no
merge, while the same corpus with those documents moved into training does get
one); the directory loads as ``data.tokenizer = "hf"`` with BOS/EOS/PAD = 0/1/2 and
the declared vocabulary size, and round-trips any text; bad arguments are one-line
errors that leave nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from exactstep.cli import main  # noqa: E402
from exactstep.data.config import DataConfig  # noqa: E402
from exactstep.data.corpus import load_corpus, val_bucket  # noqa: E402
from exactstep.errors import ConfigError, DataError  # noqa: E402

MARKER = "QZQZQZQZ"  # appears only in validation documents
FILES = ("tokenizer.json", "tokenizer_config.json", "training.json")


def write_corpus(path: Path, n: int = 200, val_fraction: float = 0.05) -> list[int]:
    """``n`` JSONL documents; those the split puts in validation carry ``MARKER``.
    Returns their line numbers (the split is decided by the name ``<file>:<line>``)."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    val_lines, lines = [], []
    for i in range(n):
        line = i + 1
        text = " ".join(words[(i * 5 + j * 3) % len(words)] for j in range(20 + i % 13))
        if val_bucket(f"{path.name}:{line}") < val_fraction:
            text = f"{MARKER} {text} {MARKER}{MARKER}"
            val_lines.append(line)
        lines.append(json.dumps({"text": text}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return val_lines


def train(tmp_path: Path, name: str, source: Path, vocab: int = 320) -> tuple[int, Path]:
    out = tmp_path / name
    code = main(["tokenizer", "train", "--source", str(source), "--vocab-size", str(vocab),
                 "--out", str(out)])
    return code, out


def test_same_corpus_and_size_give_byte_identical_files(tmp_path, capsys) -> None:
    source = tmp_path / "docs.jsonl"
    write_corpus(source)
    code_a, a = train(tmp_path, "a", source)
    code_b, b = train(tmp_path, "b", source)
    code_c, c = train(tmp_path, "c", source, vocab=300)
    assert code_a == code_b == code_c == 0
    assert sorted(p.name for p in a.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # negative control: the comparison sees a different vocabulary
    assert (a / "tokenizer.json").read_bytes() != (c / "tokenizer.json").read_bytes()
    assert "320 tokens" in capsys.readouterr().out


def test_validation_documents_are_never_seen(tmp_path) -> None:
    from exactstep.data.bpe import train_on

    source = tmp_path / "docs.jsonl"
    val_lines = write_corpus(source)
    corpus = load_corpus(DataConfig(source=str(source)))
    assert sorted(int(d.name.split(":")[1]) for d in corpus.val) == val_lines  # the run's split
    assert val_lines and all(MARKER not in d.text for d in corpus.train)

    code, out = train(tmp_path, "tok", source)
    assert code == 0
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert not [token for token in vocab if "QZ" in token]
    record = json.loads((out / "training.json").read_text())
    assert record["corpus_fingerprint"] == corpus.fingerprint
    assert record["train_documents"] == len(corpus.train)

    # negative control: with the validation documents in training the marker is merged
    leaked = train_on(type(corpus)(train=corpus.train + corpus.val, val=(),
                                   fingerprint="", source="", split_rule=""), 320)
    assert [token for token in leaked.get_vocab() if "QZ" in token]


def test_loads_as_an_hf_tokenizer_with_the_declared_specials(tmp_path) -> None:
    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    source = tmp_path / "docs.jsonl"
    write_corpus(source)
    code, out = train(tmp_path, "tok", source, vocab=300)
    assert code == 0
    tokenizer = load_hf_tokenizer(out)
    assert tokenizer.vocab_size == 300
    assert tokenizer.special_ids() == {"bos": 0, "eos": 1, "pad": 2}
    text = "unseen ünïcödé ✓ text\n\tQZQZ 12345 <b> </s>"
    ids = tokenizer.encode(text)
    assert all(3 <= i < 300 for i in ids)  # byte-level: no unknown, no special from text
    assert tokenizer.decode(ids) == text
    # the post-processor prepends BOS as a Llama tokenizer does; exactstep never asks for it
    assert tokenizer.hf("alpha")["input_ids"][0] == 0
    assert tokenizer.encode("alpha")[0] != 0


@pytest.mark.parametrize("vocab", [258, 10**7])
def test_a_vocabulary_size_out_of_range_is_one_line(tmp_path, capsys, vocab) -> None:
    source = tmp_path / "docs.jsonl"
    write_corpus(source, n=20)
    code, out = train(tmp_path, "tok", source, vocab=vocab)
    err = capsys.readouterr().err
    assert code == ConfigError.exit_code == 2
    assert err.startswith("error: --vocab-size must be between 259") and err.count("\n") == 1
    assert not out.exists()


def test_an_existing_directory_or_missing_data_is_refused(tmp_path, capsys) -> None:
    source = tmp_path / "docs.jsonl"
    write_corpus(source, n=20)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    code, _ = train(tmp_path, "busy", source)
    err = capsys.readouterr().err
    assert code == 2 and "--out" in err and err.count("\n") == 1
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]

    code, out = train(tmp_path, "tok", tmp_path / "missing.jsonl")
    err = capsys.readouterr().err
    assert code == DataError.exit_code and "missing.jsonl" in err and err.count("\n") == 1
    assert not out.exists()


TEXTS = ["plain ascii text", "ünïcödé ✓ 漢字 and emoji 🙂", "\t\n  spaces\r\n", "QZQZ <b> </s>"]


def test_byte_lengths_spell_the_utf8_bytes_of_any_text(tmp_path) -> None:
    """``byte_lengths`` (for bits per byte) against the text's own UTF-8 length; the
    EOS target counts one, BOS and PAD nothing, as for the byte tokenizer."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from exactstep.data.hf_tokenizer import load_hf_tokenizer
    from exactstep.data.tokenizer import ByteTokenizer

    source = tmp_path / "docs.jsonl"
    write_corpus(source)
    code, out = train(tmp_path, "tok", source, vocab=300)
    assert code == 0
    tokenizer = load_hf_tokenizer(out)
    lengths = tokenizer.byte_lengths()
    assert lengths.shape == (300,)
    assert (lengths[0], lengths[1], lengths[2]) == (0, 1, 0)  # <bos>, <eos>, <pad>
    byte = ByteTokenizer()

    @settings(max_examples=200, deadline=None)
    @given(st.text() | st.sampled_from(["<eos>", "a<bos>b", "<pad><eos>", "x <eos> y"]))
    def spells(text: str) -> None:
        ids = tokenizer.encode_array(text)  # a document's ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
        assert int(byte.byte_lengths()[byte.encode(text)].sum()) == len(text.encode("utf-8"))

    spells()
    # negative control: the length of each id's own decoded text miscounts multi-byte text
    ids = tokenizer.encode(TEXTS[1])
    decoded = sum(len(tokenizer.hf.decode([i]).encode("utf-8")) for i in ids)
    assert decoded != len(TEXTS[1].encode("utf-8"))


def test_a_tokenizer_that_is_not_byte_level_has_no_byte_lengths(tmp_path) -> None:
    """A WordPiece tokenizer's pieces are not bytes: per token figures only."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(TEXTS * 10, trainers.WordPieceTrainer(
        vocab_size=80, special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"], show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                            bos_token="[BOS]", eos_token="[EOS]").save_pretrained(tmp_path / "wp")
    assert load_hf_tokenizer(tmp_path / "wp").byte_lengths() is None


def test_a_document_quoting_a_special_token_gets_no_special_id(tmp_path) -> None:
    """A document's text is data: ``<eos>`` written in it is five bytes of text, not
    the EOS id (the only EOS of a text example is the one exactstep appends). A
    rendered template's ``encode`` (negative control) does turn it into the id."""
    from exactstep.data.documents import Document
    from exactstep.data.hf_tokenizer import load_hf_tokenizer
    from exactstep.rows.example import encode_documents

    source = tmp_path / "docs.jsonl"
    write_corpus(source)
    code, out = train(tmp_path, "tok", source, vocab=300)
    assert code == 0
    tokenizer = load_hf_tokenizer(out)
    text = "print('<eos>') # <bos> and <pad> are just text here"
    (example,) = encode_documents([Document(name="quote", text=text)], tokenizer)
    inner = example.tokens[1:-1].tolist()
    assert example.tokens[0] == tokenizer.bos_id and example.tokens[-1] == tokenizer.eos_id
    assert not {0, 1, 2} & set(inner)
    assert tokenizer.decode(inner) == text
    assert {0, 1, 2} <= set(tokenizer.encode(text))  # template markup is recognised
