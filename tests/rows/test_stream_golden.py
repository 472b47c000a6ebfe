"""Golden digests of packed streams: batches, cursor and data report, bitwise (R4, R7, P2, S2).

Each case packs a small synthetic corpus -- prepared shards (``PreparedDocuments``
over in-memory shard arrays: several shards, a short last block, text and chat
ownership bits) or examples in memory (``ExampleTable``, with L3 weights) -- under
one setting of the planner and the causal compiler, and digests, after every batch,
every tensor (dtype, shape and bytes), the row addresses, the stream's
``state_dict`` and the data report. ``golden_stream.json`` holds the digests the
per-document planner and compiler produced before they were vectorised; a faster
implementation must reproduce every one of them (batches, resume cursor and report
identical, so runs and resumes do not change).

Negative controls: a planner that breaks best-fit ties by the latest arrival, a
block order without the in-block permutation, and a compiler that leaves the
boundary's last label in place each change the digests.

Regenerate (only when the contract itself changes) with
``python tests/rows/test_stream_golden.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from rows_reference import assert_causal_rows

from exactstep.data.prepared import PreparedSplit, Shard
from exactstep.rows.batch import Batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner
from exactstep.rows.prepared import PreparedDocuments
from exactstep.rows.stream import RowStream, eval_batches

GOLDEN = Path(__file__).with_name("golden_stream.json")
SEQ_LEN, ROWS, BUFFER, BLOCK = 64, 4, 16, 13
PAD, VOCAB = 258, 259


def lengths_of(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths around 20 tokens; a few longer than ``SEQ_LEN`` (cuts)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(np.log(18), 0.9, n).astype(np.int64))
    lengths[rng.integers(0, n, 6)] = rng.integers(SEQ_LEN + 1, 3 * SEQ_LEN, 6)
    return lengths


def owned_bits(tokens: np.ndarray, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(len(tokens)) < 0.6


def prepared_split(n: int, seed: int, *, chat: bool, shards: int = 3) -> PreparedSplit:
    """``n`` documents cut into ``shards`` shards (in-memory arrays in the shard layout)."""
    lengths = lengths_of(n, seed)
    rng = np.random.default_rng(seed + 1)
    bounds = np.linspace(0, n, shards + 1).astype(int)
    parts = []
    for k in range(shards):
        part = lengths[bounds[k]: bounds[k + 1]]
        tokens = rng.integers(0, 256, int(part.sum())).astype(np.uint16)
        offsets = np.concatenate([[0], np.cumsum(part)[:-1]])
        owned = owned_bits(tokens, seed + 10 + k) if chat else None
        targets = []
        for off, length in zip(offsets, part, strict=True):
            targets.append(int(owned[off + 1: off + length].sum()) if chat else int(length - 1))
        index = np.stack([offsets, part, np.array(targets, dtype=np.int64)], axis=1)
        parts.append(Shard(tokens, index.astype(np.int64),
                           None if owned is None else np.packbits(owned)))
    return PreparedSplit(parts, {"min_length": int(lengths.min()),
                                 "max_length": int(lengths.max())})


def memory_examples(n: int, seed: int, *, weighted: bool, chat: bool) -> list[Example]:
    lengths = lengths_of(n, seed)
    rng = np.random.default_rng(seed + 2)
    out = []
    for i, length in enumerate(lengths):
        tokens = rng.integers(0, 256, int(length)).astype(np.int64)
        owned = owned_bits(tokens, seed + i) if chat else None
        weight = float(rng.random() * 2) if weighted else None
        out.append(Example(example_id=1000 + i, tokens=tokens, owned=owned, weight=weight))
    return out


def digest_batch(batch: Batch) -> str:
    h = hashlib.sha256()
    for name in ("input_ids", "labels", "position_ids", "segment_ids", "weights"):
        t = getattr(batch, name)
        if t is None:
            h.update(f"{name}:none;".encode())
            continue
        assert t.is_contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.numpy().tobytes())
    h.update(repr(batch.segments).encode())
    h.update(repr((batch.causal, batch.prefix_len, batch.source, batch.order)).encode())
    return h.hexdigest()


def digest_json(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


CASES: dict[str, dict] = {
    "prepared-text-split": dict(source="prepared", chat=False),
    "prepared-text-truncate-keep": dict(source="prepared", chat=False, overlong="truncate",
                                        boundary="keep"),
    "prepared-text-drop-continue": dict(source="prepared", chat=False, overlong="drop",
                                        positions="continue"),
    "prepared-chat-split": dict(source="prepared", chat=True),
    "prepared-chat-keep-rank1": dict(source="prepared", chat=True, boundary="keep",
                                     rank=1, world=3),
    "prepared-unshuffled-finite": dict(source="prepared", chat=False, shuffle=False,
                                       repeat=False),
    "prepared-one-shard-buffer1": dict(source="prepared", chat=True, shards=1, buffer=1),
    "memory-text-weighted": dict(source="memory", chat=False, weighted=True),
    "memory-chat-keep-truncate": dict(source="memory", chat=True, boundary="keep",
                                      overlong="truncate", rank=0, world=2),
    "memory-finite": dict(source="memory", chat=False, repeat=False, shuffle=False),
}
BATCHES = 40  # more than an epoch of every case (epoch barrier, next block order)


def table_of(case: dict):
    if case["source"] == "prepared":
        return PreparedDocuments(prepared_split(230, 7, chat=case["chat"],
                                                shards=case.get("shards", 3)), BLOCK)
    return memory_examples(230, 7, weighted=case.get("weighted", False), chat=case["chat"])


def stream_of(case: dict, examples) -> RowStream:
    cfg = BatchConfig(seq_len=SEQ_LEN, rows=ROWS, buffer=case.get("buffer", BUFFER),
                      boundary=case.get("boundary", "ignore"),
                      positions=case.get("positions", "reset"),
                      overlong=case.get("overlong", "split"))
    return RowStream(examples, cfg, pad_id=PAD, seed=11, vocab_size=VOCAB,
                     repeat=case.get("repeat", True), shuffle=case.get("shuffle", True),
                     rank=case.get("rank", 0), world=case.get("world", 1))


def stream_digests(case: dict) -> dict:
    """Per batch: the batch's digest and the state's digest after it; then the report."""
    examples = table_of(case)
    stream = stream_of(case, examples)
    batches, states = [], []
    for _ in range(BATCHES):
        batch = stream.next_batch()
        if batch is None:
            break
        batches.append(digest_batch(batch))
        states.append(digest_json(stream.state_dict()))
    return {"batches": batches, "states": states, "report": digest_json(stream.report())}


def eval_digests() -> dict:
    out = {}
    for chat in (False, True):
        docs = PreparedDocuments(prepared_split(120, 3, chat=chat), BLOCK)
        cfg = BatchConfig(seq_len=SEQ_LEN, rows=ROWS, buffer=BUFFER)
        out[f"eval-prepared-{'chat' if chat else 'text'}"] = [
            digest_batch(b) for b in eval_batches(docs, cfg, pad_id=PAD, vocab_size=VOCAB)]
    return out


def planner_digests() -> dict:
    """Rows of pieces and the planner state under a compiler's charges (rows.packing)."""
    docs = PreparedDocuments(prepared_split(230, 5, chat=False), BLOCK)
    planner = PackPlanner(docs, seq_len=SEQ_LEN, buffer=BUFFER, overlong="split", seed=3,
                          cost=lambda n: min(SEQ_LEN, n + n // 8 + 1))
    rows = [repr(planner.next_row()) for _ in range(150)]
    return {"rows": digest_json(rows), "state": digest_json(planner.state_dict())}


def all_digests() -> dict:
    return {"streams": {name: stream_digests(case) for name, case in CASES.items()},
            "eval": eval_digests(), "planner": planner_digests()}


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_stream_matches_its_golden_digests(name: str, golden: dict) -> None:
    got = stream_digests(CASES[name])
    want = golden["streams"][name]
    assert len(got["batches"]) == len(want["batches"])
    for k, (g, w) in enumerate(zip(got["batches"], want["batches"], strict=True)):
        assert g == w, f"batch {k} differs"
    for k, (g, w) in enumerate(zip(got["states"], want["states"], strict=True)):
        assert g == w, f"state after batch {k} differs"
    assert got["report"] == want["report"]


def test_eval_batches_match_their_golden_digests(golden: dict) -> None:
    assert eval_digests() == golden["eval"]


def test_planner_with_charges_matches_its_golden_digests(golden: dict) -> None:
    assert planner_digests() == golden["planner"]


@pytest.mark.parametrize("name", ["prepared-chat-split", "memory-text-weighted"])
def test_resumed_stream_continues_bitwise(name: str, golden: dict) -> None:
    """A state taken after 9 batches, loaded into a fresh stream, yields the golden
    batches 10, 11, ... (S2)."""
    case = CASES[name]
    stream = stream_of(case, table_of(case))
    for _ in range(9):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))
    fresh = stream_of(case, table_of(case))
    fresh.load_state_dict(state)
    got = [digest_batch(fresh.next_batch()) for _ in range(12)]
    assert got == golden["streams"][name]["batches"][9:21]


def test_state_loaded_into_a_stream_that_ran_on_rewinds_it(golden: dict) -> None:
    """Loading an earlier state into the same stream (its read-ahead window already
    past that cursor) yields the golden batches from there again (S2)."""
    case = CASES["prepared-text-drop-continue"]
    stream = stream_of(case, table_of(case))
    for _ in range(9):
        stream.next_batch()
    state = json.loads(json.dumps(stream.state_dict()))
    for _ in range(20):
        stream.next_batch()
    stream.load_state_dict(state)
    got = [digest_batch(stream.next_batch()) for _ in range(12)]
    assert got == golden["streams"]["prepared-text-drop-continue"]["batches"][9:21]


@pytest.mark.parametrize("name", ["prepared-text-split", "prepared-chat-keep-rank1",
                                  "prepared-text-drop-continue", "memory-chat-keep-truncate"])
def test_batches_hold_what_the_row_contract_says(name: str) -> None:
    """Independently of the digests: every column of the first batches is what the
    plain-Python contract (``rows_reference``) computes from the row addresses and
    each document read on its own (``PreparedDocuments[d]``, one ``Example``)."""
    case = CASES[name]
    examples = table_of(case)
    stream = stream_of(case, examples)
    whole = [examples[i] for i in range(len(examples))]
    for _ in range(6):
        batch = stream.next_batch()
        assert_causal_rows(batch, whole, case.get("boundary", "ignore"),
                           case.get("positions", "reset"), PAD)


# --------------------------------------------------------------- negative controls


def test_latest_arrival_tie_break_changes_the_digests(golden: dict, monkeypatch) -> None:
    """Negative control: a planner that breaks best-fit ties by the latest arrival
    instead of the earliest (the last key of the chosen cost, not the first); the
    same planner breaking ties right (the Python oracle) gives the golden digests."""
    from planner_reference import LatestOnTies, ReferencePlanner

    from exactstep.rows import stream

    monkeypatch.setattr(stream, "PackPlanner", ReferencePlanner)
    assert stream_digests(CASES["prepared-text-split"]) == golden["streams"]["prepared-text-split"]
    monkeypatch.setattr(stream, "PackPlanner", LatestOnTies)
    got = stream_digests(CASES["prepared-text-split"])
    assert got["batches"] != golden["streams"]["prepared-text-split"]["batches"]


def test_unpermuted_blocks_change_the_digests(golden: dict, monkeypatch) -> None:
    """Negative control: a block order that keeps each block's documents in id order."""
    from exactstep.rows import prepared

    original = prepared.PreparedDocuments.shard_order

    def unpermuted(self, seed, epoch, *, shuffle, rank, world):
        return original(self, seed, epoch, shuffle=False, rank=rank, world=world)

    monkeypatch.setattr(prepared.PreparedDocuments, "shard_order", unpermuted)
    got = stream_digests(CASES["prepared-text-split"])
    assert got["batches"][0] != golden["streams"]["prepared-text-split"]["batches"][0]


def test_a_label_on_the_boundary_changes_the_digests(golden: dict, monkeypatch) -> None:
    """Negative control: batches whose first row's last real label is not ignored."""
    from exactstep.rows import stream as stream_module

    original = stream_module.batch_maker

    def leaky_maker(*args, **kw):
        make = original(*args, **kw)

        def leaky(rows):
            batch, targets = make(rows)
            labels = batch.labels.clone()
            seg = batch.segments[0][0]
            labels[0, seg.stop - 1] = 7
            return Batch(batch.input_ids, labels, batch.position_ids, batch.segment_ids,
                         batch.segments, weights=batch.weights), targets + 1

        return leaky

    monkeypatch.setattr(stream_module, "batch_maker", leaky_maker)
    got = stream_digests(CASES["memory-text-weighted"])
    assert got["batches"][0] != golden["streams"]["memory-text-weighted"]["batches"][0]


if __name__ == "__main__" and "--write" in sys.argv:
    torch.set_num_threads(1)
    GOLDEN.write_text(json.dumps(all_digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
