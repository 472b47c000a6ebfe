"""Prepared token shards (P1, P2): written identically for any worker count, read
back as the examples the source gives, streamed in the declared block order, resumed
bitwise, and refused when a shard is missing, truncated or altered (S6).

Expectations are computed here independently: a document's tokens from its text's
UTF-8 bytes, the epoch order from the rule as ``prepared.json`` declares it.
Negative controls: a writer whose chunk order depends on the worker count breaks the
byte-identity check, an order rule without the in-block permutation fails the order
check, and a resume from a cursor one document off yields other batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from run_support import write_texts

import exactstep.artifacts.prepare as prepare_module
from exactstep.artifacts.prepare import prepare
from exactstep.config import load_config
from exactstep.data.prepared import MANIFEST, open_prepared
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import DataError
from exactstep.rows.config import BatchConfig
from exactstep.rows.prepared import PreparedDocuments
from exactstep.rows.stream import RowStream

TOK = ByteTokenizer()


def texts(n: int = 90) -> list[str]:
    """Documents of varied length (7 .. 300 bytes), some multi-byte characters."""
    words = "alpha beta gamma delta épsilon zeta eta théta iota kappa".split()
    return [f"{i} " + " ".join(words[(i * 7 + j) % len(words)] for j in range(1 + (i * 13) % 40))
            for i in range(n)]


def make(tmp: Path, name: str, *, workers: int = 1, kind: str = "text", items=None,
         shard_tokens: int = 900, block: int = 8, overrides: tuple[str, ...] = ()) -> Path:
    source = write_texts(tmp / "corpus.jsonl", texts() if items is None else items)
    cfg = load_config(None, [f"data.kind={kind}", "data.val_fraction=0.2", *overrides])
    out = tmp / name
    prepare(cfg, str(source), out, workers=workers, shard_tokens=shard_tokens,
            block_documents=block, progress=False)
    return out


def files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("prepared"), "p")


# --------------------------------------------------------------------------- P1


@pytest.mark.slow
def test_shards_are_byte_identical_for_any_worker_count(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 8)  # many chunks per worker
    one = make(tmp_path, "one", workers=1)
    three = make(tmp_path, "three", workers=3)
    assert len([n for n in files(one) if n.endswith(".tokens")]) > 3  # several shards
    assert files(one) == files(three)


def test_a_worker_dependent_writer_fails_the_identity_check(tmp_path: Path,
                                                            monkeypatch) -> None:
    """Negative control: an encoder that hands chunks back in another order (as
    completion order would) must break the byte-identity check."""
    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 8)
    one = make(tmp_path, "one", workers=1)
    monkeypatch.setattr(prepare_module, "encoder", Reversed)
    other = make(tmp_path, "other", workers=2)
    assert files(one) != files(other)


class Reversed:
    """An in-process encoder that emits chunks in reverse order (deliberately wrong)."""

    def __init__(self, cfg, workers: int) -> None:
        self.cfg = cfg

    def __enter__(self):
        prepare_module.init_worker(self.cfg)
        return lambda items: map(prepare_module.encode_chunk, list(items)[::-1])

    def __exit__(self, *exc):
        return None


def test_documents_are_bos_utf8_bytes_eos_with_every_target_owned(prepared: Path) -> None:
    meta = json.loads((prepared / MANIFEST).read_text())
    docs = PreparedDocuments(open_prepared(prepared).splits["train"], 8)
    by_text = {t.encode("utf-8"): t for t in texts()}
    seen = set()
    for i in range(len(docs)):
        example = docs[i]
        assert example.tokens[0] == TOK.bos_id and example.tokens[-1] == TOK.eos_id
        body = bytes(example.tokens[1:-1].astype(np.uint8).tolist())
        assert body in by_text
        assert example.owned is None
        assert docs.lengths[i] == len(body) + 2 and docs.targets[i] == len(body) + 1
        seen.add(body)
    assert len(seen) == meta["splits"]["train"]["documents"] == len(docs)
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 90
    assert meta["dtype"] == "uint16"


def test_chat_documents_keep_their_ownership_bits(tmp_path: Path) -> None:
    """R5: the stored bits are the in-memory compiler's, token for token."""
    from exactstep.data.chat import load_chat_jsonl, template_for
    from exactstep.rows.chat import ChatPolicy, chat_examples

    chats = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                           {"role": "assistant", "content": f"{2 * i}"}]} for i in range(40)]
    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chats))
    cfg = load_config(None, ["data.kind=chat", "data.val_fraction=0.2", "batch.seq_len=64"])
    out = tmp_path / "chat"
    prepare(cfg, str(source), out, workers=2, shard_tokens=200, block_documents=4,
            progress=False)
    prepared = open_prepared(out)
    stored = [PreparedDocuments(prepared.splits[s], 4) for s in ("train", "val")]
    conversations = load_chat_jsonl(source)
    expected, _ = chat_examples(conversations, TOK, ChatPolicy(), max_len=64,
                                template=template_for(TOK))
    from exactstep.rows.sources import load_bundle

    bundle = load_bundle(load_config(None, ["data.kind=chat", "batch.seq_len=64",
                                            f"data.source={out}"]), TOK)
    assert len(bundle.train) + len(bundle.val) == len(expected)  # the run accepts it
    got = {bytes(d[i].tokens.astype(np.uint8)): d[i].owned for d in stored for i in range(len(d))}
    assert len(got) == len(expected)
    for example in expected:
        owned = got[bytes(example.tokens.astype(np.uint8))]
        assert owned is not None and owned.tolist() == example.owned.tolist()


def test_zero_documents_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no non-empty document"):
        make(tmp_path, "empty", items=["", ""])
    assert not (tmp_path / "empty").exists()


def test_an_interrupted_prepare_publishes_nothing_and_can_start_again(tmp_path: Path,
                                                                       monkeypatch) -> None:
    """S3: the directory appears only once complete; a leftover ``.partial`` is
    replaced by the next attempt."""
    def fail(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "manifest", fail)
    with pytest.raises(KeyboardInterrupt):
        make(tmp_path, "p")
    assert not (tmp_path / "p").exists() and (tmp_path / ".p.partial").is_dir()
    monkeypatch.undo()
    out = make(tmp_path, "p")
    assert not (tmp_path / ".p.partial").exists()
    assert open_prepared(out).splits["train"].documents > 0


KILLER = r"""
import os, signal, sys
import exactstep.artifacts.prepare as prepare
nth, argv, calls = int(sys.argv[1]), sys.argv[2:], [0]
close = prepare.SplitWriter._close_shard
def killing_close(self):
    calls[0] += 1
    if calls[0] == nth:
        os.kill(os.getpid(), signal.SIGKILL)   # mid-way: some shards written, some not
    close(self)
prepare.SplitWriter._close_shard = killing_close
from exactstep.cli import main
sys.exit(main(argv))
"""


@pytest.mark.slow
def test_sigkill_during_prepare_publishes_nothing_and_a_rerun_is_exact(tmp_path: Path) -> None:
    """P1, S3 with a real SIGKILL: nothing appears at --out, and preparing again
    gives the bytes of an uninterrupted preparation."""
    import sys

    import process_server

    source = write_texts(tmp_path / "corpus.jsonl", texts())
    argv = ["prepare", str(source), "--no-progress", "--shard-tokens", "900",
            "--set", "data.val_fraction=0.2"]
    script = tmp_path / "kill.py"
    script.write_text(KILLER)

    def launch(nth: int, out: str) -> int:
        return process_server.run([sys.executable, str(script), str(nth), *argv, "--out", out],
                                  cwd=tmp_path, capture_output=True, timeout=120).returncode

    assert launch(0, "straight") == 0
    assert launch(4, "killed") == -9
    assert not (tmp_path / "killed").exists()
    partial = tmp_path / ".killed.partial"
    assert sorted(p.name for p in partial.iterdir())[:1] == ["train-00000.index"]
    assert not (partial / MANIFEST).exists()
    assert launch(0, "killed") == 0
    assert files(tmp_path / "killed") == files(tmp_path / "straight")
    assert not partial.exists()


# --------------------------------------------------------------------------- S6


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_shard_is_named(prepared: Path, tmp_path: Path, damage: str) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    victim = copy / "train-00001.tokens"
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(bytes(data[:-2]))
    elif damage == "flip":
        data[len(data) // 2] ^= 1
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    with pytest.raises(DataError, match="train-00001.tokens"):
        open_prepared(copy)
    open_prepared(prepared)  # negative control: the intact directory opens


def test_an_edited_manifest_is_refused(prepared: Path, tmp_path: Path) -> None:
    """A changed setting in ``prepared.json`` (here the declared order) breaks the
    fingerprint; a directory whose ``prepared.json`` is gone is named as unprepared."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    meta = json.loads((copy / MANIFEST).read_text())
    meta["order"]["block_documents"] = 9
    (copy / MANIFEST).write_text(json.dumps(meta))
    with pytest.raises(DataError, match="was edited"):
        open_prepared(copy)
    (copy / MANIFEST).unlink()
    from exactstep.rows.sources import load_bundle

    with pytest.raises(DataError, match="no prepared.json"):
        load_bundle(load_config(None, [f"data.source={copy}"]), TOK)


# --------------------------------------------------------------------------- P2


def declared_order(n: int, block: int, seed: int, epoch: int) -> list[int]:
    """The rule as written in ``docs/design/rows.md#rowspreparedpy`` (``BlockOrder``), reimplemented."""
    blocks = [list(range(b * block, min(n, (b + 1) * block))) for b in range(-(-n // block))]
    order = []
    for b in np.random.default_rng([seed, epoch]).permutation(len(blocks)):
        perm = np.random.default_rng([seed, epoch, int(b)]).permutation(len(blocks[b]))
        order += [blocks[b][k] for k in perm]
    return order


def test_each_epoch_follows_the_declared_block_order_sharded_by_rank(prepared: Path) -> None:
    docs = PreparedDocuments(open_prepared(prepared).splits["train"], 7)
    n = len(docs)
    assert n % 7  # the last block is short
    for epoch in (0, 1):
        whole = declared_order(n, 7, seed=5, epoch=epoch)
        assert sorted(whole) == list(range(n))
        for world in (1, 3):
            shards = [list(docs.shard_order(5, epoch, shuffle=True, rank=r, world=world))
                      for r in range(world)]
            assert shards == [whole[r::world] for r in range(world)]
    assert declared_order(n, 7, 5, 0) != declared_order(n, 7, 5, 1)
    unshuffled = list(docs.shard_order(5, 0, shuffle=False, rank=0, world=1))
    assert unshuffled == list(range(n))


def test_an_order_without_the_in_block_permutation_fails_the_check(prepared: Path) -> None:
    """Negative control for the order check above."""
    docs = PreparedDocuments(open_prepared(prepared).splits["train"], 7)
    n = len(docs)
    wrong = []
    for b in np.random.default_rng([5, 0]).permutation(-(-n // 7)):
        wrong += list(range(b * 7, min(n, (b + 1) * 7)))
    assert list(docs.shard_order(5, 0, shuffle=True, rank=0, world=1)) != wrong


def stream(prepared: Path, **kw) -> RowStream:
    docs = PreparedDocuments(open_prepared(prepared).splits["train"], 8)
    cfg = BatchConfig(seq_len=48, rows=3, buffer=6)
    return RowStream(docs, cfg, pad_id=TOK.pad_id, seed=5, vocab_size=TOK.vocab_size, **kw)


def batch_bytes(batch) -> bytes:
    return b"".join(t.numpy().tobytes() for t in (batch.input_ids, batch.labels,
                                                   batch.position_ids, batch.segment_ids))


def test_the_stream_covers_every_document_once_per_epoch(prepared: Path) -> None:
    s = stream(prepared, repeat=False)
    docs = s.planner.table
    seen = []
    for batch in s:
        for row in batch.segments:
            seen += [seg.example_id for seg in row if seg.piece == 0]
    assert sorted(seen) == list(range(len(docs)))
    assert s.report()["documents"] == len(docs)


def test_a_resumed_stream_is_bitwise_the_uninterrupted_one(prepared: Path) -> None:
    straight = stream(prepared)
    expected = [batch_bytes(straight.next_batch()) for _ in range(100)]  # > one epoch
    assert straight.planner.epoch >= 1
    first = stream(prepared)
    head = [batch_bytes(first.next_batch()) for _ in range(37)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = stream(prepared)
    resumed.load_state_dict(state)
    assert head + [batch_bytes(resumed.next_batch()) for _ in range(63)] == expected
    assert len(state["planner"]["pending"]) <= 6 + 1  # the bounded buffer is the remainder

    state["planner"]["cursor"] += 1  # negative control: one document off
    shifted = stream(prepared)
    shifted.load_state_dict(state)
    assert [batch_bytes(shifted.next_batch()) for _ in range(63)] != expected[37:]


def test_rank_shards_are_disjoint_and_cover_the_epoch(prepared: Path) -> None:
    seen = []
    for rank in range(2):
        s = stream(prepared, repeat=False, rank=rank, world=2)
        for batch in s:
            seen += [seg.example_id for row in batch.segments for seg in row if seg.piece == 0]
    assert sorted(seen) == list(range(len(stream(prepared).planner.table)))


def test_another_tokenizer_is_refused_naming_both_hashes(prepared: Path, tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    import tokenizer_support

    from exactstep.data.tokenizer import build_tokenizer
    from exactstep.errors import ConfigError
    from exactstep.rows.sources import load_bundle

    tokenizer_support.save_tokenizer(tmp_path / "tok")
    cfg = load_config(None, [f"data.source={prepared}", "data.tokenizer=hf",
                             f"data.tokenizer_path={tmp_path / 'tok'}"])
    run_tokenizer = build_tokenizer(cfg)
    recorded = json.loads((prepared / MANIFEST).read_text())["representation"]["tokenizer_hash"]
    assert recorded == TOK.fingerprint() != run_tokenizer.fingerprint()
    with pytest.raises(ConfigError) as refused:
        load_bundle(cfg, run_tokenizer)
    assert recorded in str(refused.value) and run_tokenizer.fingerprint() in str(refused.value)
    same = load_config(None, [f"data.source={prepared}"])  # control: the same tokenizer opens
    assert len(load_bundle(same, TOK).train) == open_prepared(prepared).splits["train"].documents


def test_the_loader_benchmark_writes_a_corpus_that_verifies(tmp_path: Path) -> None:
    """``exactstep bench loader`` measures a valid prepared directory (no timing)."""
    from exactstep.bench.loader import packed_tokens, packing_stream, write_synthetic

    path = write_synthetic(tmp_path / "synthetic", 1)
    info = open_prepared(path).splits["train"].info  # every size and sha256 checked
    assert abs(info["tokens"] * 2 - (1 << 20)) < 4096
    stream = packing_stream(path)
    assert packed_tokens(stream, 2) == 2 * 8 * 2048  # rows filled: documents are short
    third = packed_tokens(stream, 1)  # the same stream, read on
    assert 0 < third <= 8 * 2048
    assert stream.report()["real_tokens"] == 2 * 8 * 2048 + third


def test_the_loader_benchmarks_compiled_floor_builds_clean_batches(tmp_path: Path) -> None:
    """The floor ``bench loader`` reports (``kernels_us``) times C calls that build
    the real batches: their outputs are what the NumPy compiler builds from the same
    plan, bitwise, and the screen clears them (no timing is asserted)."""
    import torch

    from exactstep.bench.loader import (
        ROWS,
        SEQ_LEN,
        compiled_work,
        packing_stream,
        write_synthetic,
    )
    from exactstep.data.tokenizer import ByteTokenizer
    from exactstep.rows.causal import compile_causal_batch

    stream = packing_stream(write_synthetic(tmp_path / "synthetic", 1))
    plans = [stream.planner.next_plan(ROWS) for _ in range(3)]
    outputs = tuple(torch.empty(ROWS, SEQ_LEN, dtype=d)
                    for d in (torch.int64, torch.int64, torch.int64, torch.int32))
    tok = ByteTokenizer()
    fill = stream.examples.kernel_maps().causal_fill(SEQ_LEN, tok.pad_id, False, True,
                                                     (tok.vocab_size, True, True))
    seconds, tokens = compiled_work(plans, fill, outputs)
    assert seconds > 0 and tokens == sum(int(p.pieces[2].sum()) for p in plans) / 3
    last = compile_causal_batch(plans[-1].rows(), stream.examples, seq_len=SEQ_LEN,
                                pad_id=ByteTokenizer().pad_id)  # lists: the NumPy compiler
    expected = (last.input_ids, last.labels, last.position_ids, last.segment_ids)
    for built, wanted in zip(outputs, expected, strict=True):
        assert torch.equal(built, wanted)


def test_a_declared_reshard_continues_with_the_next_epochs_declared_order(prepared: Path) -> None:
    """S7, D3: two ranks stop mid-epoch; the reshard rule moves three new ranks to the
    start of the next epoch, and each then packs exactly its stride of that epoch's
    declared order. Loading an old rank's cursor without the rule is refused."""
    from exactstep.errors import ResumeError
    from exactstep.parallel.dcp_format import reshard_stream_state

    old = [stream(prepared, repeat=False, rank=r, world=2) for r in range(2)]
    for s in old:
        for _ in range(5):
            s.next_batch()
    old_data = [json.loads(json.dumps(s.state_dict())) for s in old]
    assert {d["planner"]["epoch"] for d in old_data} == {0}
    n = len(old[0].planner.table)
    whole = declared_order(n, 8, seed=5, epoch=1)
    for rank in range(3):
        new = stream(prepared, repeat=False, rank=rank, world=3)
        with pytest.raises(ResumeError, match="world"):
            new.load_state_dict(old_data[0])
        new.load_state_dict(reshard_stream_state(old_data, new.state_dict()))
        seen = [seg.example_id for batch in new for row in batch.segments for seg in row
                if seg.piece == 0]
        assert sorted(seen) == sorted(whole[rank::3])


def test_ids_beyond_uint16_are_stored_as_uint32(tmp_path: Path) -> None:
    """P1: ``uint16`` exactly when every id fits; a larger vocabulary keeps its ids."""
    from exactstep.artifacts.prepare import SplitWriter
    from exactstep.data.prepared import PreparedSplit, open_shard, token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    writer = SplitWriter(tmp_path, "train", token_dtype(70_000), True, 1 << 20, 70_000)
    docs = [np.array([1, 65_535, 65_536, 69_999]), np.array([7, 8, 9])]
    owned = [np.array([False, True, False, True]), np.array([False, False, True])]
    for tokens, bits in zip(docs, owned, strict=True):
        writer.add(tokens, bits)
    record = writer.close()
    split = PreparedSplit([open_shard(tmp_path, s["files"], np.dtype(np.uint32))
                           for s in record["shards"]], record)
    for i, (tokens, bits) in enumerate(zip(docs, owned, strict=True)):
        got, got_owned = split.tokens(i)
        assert got.tolist() == tokens.tolist() and got_owned.tolist() == bits.tolist()
    assert [split.entry(i, 2) for i in range(2)] == [2, 1]  # owned targets after token 0


def test_a_streamed_jsonl_gives_the_documents_of_the_runs_own_reader(tmp_path: Path) -> None:
    """The streamed reader (line by line) and ``load_corpus`` (the run's reader, whole
    file) give the same documents, in the same split and order; empty lines are
    skipped and ``data.max_docs`` counts kept documents in both."""
    from exactstep.data.corpus import load_corpus

    items = texts()[:30] + ["", ""] + texts()[30:]
    overrides = ("data.max_docs=80",)
    streamed = make(tmp_path, "streamed", items=items, overrides=overrides)
    meta = json.loads((streamed / MANIFEST).read_text())
    assert "source_fingerprint_rule" in meta and meta["skipped_empty"] == 2
    corpus = load_corpus(load_config(None, [f"data.source={tmp_path / 'corpus.jsonl'}",
                                            "data.val_fraction=0.2", *overrides]).data)
    splits = open_prepared(streamed).splits
    for split, expected in (("train", corpus.train), ("val", corpus.val)):
        docs = PreparedDocuments(splits[split], 8)
        assert [bytes(docs[i].tokens[1:-1].astype(np.uint8)) for i in range(len(docs))] == \
            [d.text.encode("utf-8") for d in expected], split


def test_parquet_shards_are_streamed_one_file_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """A directory of Parquet shards: the prepared documents are ``load_corpus``'s (same
    names, so the same split), and reading is lazy: when the first document is handed
    over only the first shard file has been read (P1: memory bounded by one file)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from exactstep.data import datasets_source
    from exactstep.data.corpus import load_corpus

    shards = tmp_path / "shards"
    shards.mkdir()
    all_texts = texts(60)
    for k in range(3):
        pq.write_table(pa.table({"text": all_texts[k * 20:(k + 1) * 20]}),
                       shards / f"train-{k:05d}-of-00003.parquet")
    cfg = load_config(None, ["data.val_fraction=0.2"])
    out = tmp_path / "prepared"
    prepare(cfg, str(shards), out, shard_tokens=900, block_documents=8, progress=False)
    meta = json.loads((out / MANIFEST).read_text())
    assert meta["source_name"] == f"parquet:{shards}"
    corpus = load_corpus(load_config(None, [f"data.source={shards}",
                                            "data.val_fraction=0.2"]).data)
    splits = open_prepared(out).splits
    for split, expected in (("train", corpus.train), ("val", corpus.val)):
        docs = PreparedDocuments(splits[split], 8)
        assert [bytes(docs[i].tokens[1:-1].astype(np.uint8)).decode() for i in range(len(docs))] \
            == [d.text for d in expected], split
    read = []
    real_load = datasets_source.load_file
    monkeypatch.setattr(datasets_source, "load_file",
                        lambda ds, file, fmt, cache: read.append(file.name)
                        or real_load(ds, file, fmt, cache))
    documents = datasets_source.iter_text_source(shards)
    first = next(documents)
    assert first.name == "train-00000-of-00003.parquet#0"
    assert read == ["train-00000-of-00003.parquet"]
    assert sum(1 for _ in documents) == 59 and len(read) == 3


def test_parallel_encoding_keeps_a_bounded_number_of_chunks_in_flight() -> None:
    """P2's promise at prepare time: the source is read no further ahead than
    ``2 * workers`` chunks of the result being handed back."""
    from exactstep.data.documents import Document

    read = [0]

    def source():
        for i in range(50):
            read[0] = i + 1
            yield [("train", Document(f"d{i}", "text"))]

    cfg = load_config(None, [])
    with prepare_module.encoder(cfg, 2) as encode:
        results = encode(source())
        next(results)
        assert read[0] <= 4 + 1
        assert sum(1 for _ in results) == 49
        read[0] = 0  # negative control: Executor.map reads the whole source first
        next(encode.__self__.pool.map(prepare_module.encode_chunk, source()))
        assert read[0] == 50


@pytest.mark.slow
def test_a_hugging_face_tokenizer_prepares_identically_in_worker_processes(
        tmp_path: Path, monkeypatch) -> None:
    """P1 with ``data.tokenizer = "hf"``: each spawned worker loads the tokenizer from
    ``data.tokenizer_path`` and the shards equal one process's; the documents are
    ``BOS + encode(text) + EOS`` with the tokenizer's own ids."""
    pytest.importorskip("tokenizers")
    import tokenizer_support

    from exactstep.data.tokenizer import build_tokenizer

    monkeypatch.setattr(prepare_module, "CHUNK_DOCUMENTS", 16)
    tok_dir = tokenizer_support.save_tokenizer(tmp_path / "tok")
    hf = ("data.tokenizer=hf", f"data.tokenizer_path={tok_dir}")
    one = make(tmp_path, "one", overrides=hf)
    two = make(tmp_path, "two", workers=2, overrides=hf)
    assert files(one) == files(two)
    tokenizer = build_tokenizer(load_config(None, list(hf)))
    raw = tokenizer_support.raw_tokenizer(tok_dir)
    docs = PreparedDocuments(open_prepared(one).splits["train"], 8)
    by_ids = {tuple(raw.encode(t).ids): t for t in texts()}
    for i in range(len(docs)):
        ids = docs[i].tokens.tolist()
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert tuple(ids[1:-1]) in by_ids


def chat_lines(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"what is {i} + {i % 7}?"},
                          {"role": "assistant", "content": f"{i + i % 7}"}]} for i in range(n)]


def test_a_streamed_chat_jsonl_gives_the_runs_own_split_and_ownership(tmp_path: Path) -> None:
    """P1, R5: chat JSONL is read a line at a time, and the prepared documents of each
    split are, in order, the examples the in-memory path builds from
    ``split_conversations`` (the content-hash split, ``data.max_docs`` counted before
    it), ownership bit for bit."""
    from exactstep.data.chat import template_for
    from exactstep.rows.chat import ChatPolicy, chat_examples
    from exactstep.rows.sources import split_conversations

    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chat_lines(70)))
    overrides = ["data.kind=chat", "data.val_fraction=0.25", "batch.seq_len=64",
                 "data.max_docs=60", f"data.source={source}"]
    cfg = load_config(None, overrides)
    out = tmp_path / "chat"
    prepare(cfg, str(source), out, workers=1, shard_tokens=300, block_documents=4,
            progress=False)
    meta = json.loads((out / MANIFEST).read_text())
    assert meta["source_name"] == f"jsonl:{source}" and "source_fingerprint_rule" in meta
    train, val, rule, _ = split_conversations(cfg)
    assert meta["split_rule"] == rule and len(train) + len(val) == 60
    splits = open_prepared(out).splits
    for split, conversations in (("train", train), ("val", val)):
        expected, _ = chat_examples(conversations, TOK, ChatPolicy(), max_len=64,
                                    template=template_for(TOK))
        docs = PreparedDocuments(splits[split], 4)
        assert len(docs) == len(expected), split
        for i, example in enumerate(expected):
            assert docs[i].tokens.tolist() == example.tokens.tolist(), (split, i)
            assert docs[i].owned.tolist() == example.owned.tolist(), (split, i)


def test_chat_jsonl_is_read_one_line_at_a_time(tmp_path: Path) -> None:
    """The streamed reader hands over the conversations before a later malformed line
    is reached (nothing reads the whole file first), then names that line."""
    from exactstep.data.conversation import iter_chat_jsonl

    source = tmp_path / "chat.jsonl"
    source.write_text("".join(json.dumps(c) + "\n" for c in chat_lines(4)) + "{not json\n")
    conversations = iter_chat_jsonl(source)
    got = [next(conversations) for _ in range(4)]
    assert [c.messages[1].content for c in got] == ["0", "2", "4", "6"]
    with pytest.raises(DataError, match=r"chat.jsonl:5"):
        next(conversations)


def test_a_chat_source_without_conversations_is_one_error(tmp_path: Path) -> None:
    source = tmp_path / "chat.jsonl"
    source.write_text("\n\n")
    cfg = load_config(None, ["data.kind=chat", f"data.source={source}"])
    with pytest.raises(DataError, match="holds no conversation"):
        prepare(cfg, str(source), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_family_prepares_with_its_own_specials_and_trains_from_its_shards(tmp_path: Path
                                                                            ) -> None:
    """R8, S1: ``prepare`` encodes with the tokenizer the family's run uses (the byte
    tokenizer plus ``<mask>`` for the masked LM), so the masked-LM run accepts the
    shards and trains; shards prepared without the family carry the plain byte
    tokenizer and are refused, naming both hashes (the negative control)."""
    from exactstep.errors import ConfigError
    from exactstep.run.runner import train

    source = write_texts(tmp_path / "docs.jsonl", texts(40))
    family = ["objective.family=mlm", "data.val_fraction=0.2"]
    with_family, without = tmp_path / "mlm", tmp_path / "plain"
    prepare(load_config(None, family), str(source), with_family, progress=False)
    prepare(load_config(None, family[1:]), str(source), without, progress=False)
    run = family + ["model.d_model=16", "model.n_layers=1", "model.n_heads=2",
                    "model.d_ff=32", "batch.seq_len=64", "batch.rows=2", "train.steps=2",
                    "train.eval_tokens=200", "train.device=cpu", "train.progress=false"]
    summary = train(load_config(None, run + [f"data.source={with_family}"]), tmp_path / "r1",
                    progress=False)
    assert summary["windows"]["committed"] == 2
    meta = json.loads((with_family / MANIFEST).read_text())
    plain = json.loads((without / MANIFEST).read_text())
    assert meta["representation"]["tokenizer_hash"] != plain["representation"]["tokenizer_hash"]
    with pytest.raises(ConfigError, match=r"different tokenizer .*objective.family"):
        train(load_config(None, run + [f"data.source={without}"]), tmp_path / "r2",
              progress=False)


def test_each_rank_hashes_its_share_and_the_shares_cover_every_file(
        prepared: Path, tmp_path: Path, monkeypatch) -> None:
    """S6 at scale: ``share = (rank, world)`` hashes files ``rank, rank + world, ...``
    in name order, so the ranks of a job hash disjoint parts that cover every file;
    damage is found by the rank whose share holds the file (sizes are checked by all)."""
    import shutil

    import exactstep.data.prepared as prepared_module

    names = sorted(json.loads((prepared / MANIFEST).read_text())["files"])
    hashed: list[str] = []
    real = prepared_module.sha256_file
    monkeypatch.setattr(prepared_module, "sha256_file",
                        lambda path: hashed.append(path.name) or real(path))
    shares = []
    for rank in range(3):
        hashed.clear()
        open_prepared(prepared, share=(rank, 3))
        shares.append(set(hashed))
        assert sorted(hashed) == names[rank::3]
    assert set().union(*shares) == set(names) and sum(map(len, shares)) == len(names)

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    victim = names.index("train-00001.tokens")
    data = bytearray((copy / names[victim]).read_bytes())
    data[len(data) // 2] ^= 1  # same size: only a digest finds it
    (copy / names[victim]).write_bytes(bytes(data))
    for rank in range(3):
        if rank == victim % 3:
            with pytest.raises(DataError, match="train-00001.tokens"):
                open_prepared(copy, share=(rank, 3))
        else:
            open_prepared(copy, share=(rank, 3))  # not its file: it opens


@pytest.mark.slow
def test_a_two_rank_run_refuses_a_damaged_shard_in_one_line(prepared: Path,
                                                             tmp_path: Path) -> None:
    """``exactstep train --nproc 2`` from a directory with one altered shard: the rank
    that hashes it stops the job, and the user reads one line naming the file."""
    import os
    import shutil
    import sys

    import process_server

    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    victim = copy / "train-00001.tokens"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1
    victim.write_bytes(bytes(data))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    args = [sys.executable, "-m", "exactstep", "train", "--nproc", "2", "--no-progress",
            "--out", str(tmp_path / "run")]
    for pair in (f"data.source={copy}", "batch.seq_len=64", "batch.rows=2", "model.d_model=16",
                 "model.n_layers=1", "model.n_heads=2", "model.d_ff=32", "train.steps=2",
                 "train.threads=1", "train.device=cpu"):
        args += ["--set", pair]
    done = process_server.run(args, capture_output=True, text=True, timeout=300, env=env,
                              cwd=tmp_path)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(errors) == 1 and "train-00001.tokens" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
