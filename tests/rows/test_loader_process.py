"""Background loading in a loader process (P3): the same batches and cursor as in line,
errors where they happen, nothing copied into the child, no loader left behind.

Every ``LoaderProcess`` spawns a child (about 2 s of imports), so each test shares one
child across its assertions."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from small_streams import examples, stream

from exactstep.config import load_config
from exactstep.data.prepared import open_prepared
from exactstep.errors import BatchInvariantError, DataError, ResumeError
from exactstep.families import BUILT, open_family, resolve
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.loader_process import (
    LoaderProcess,
    Slab,
    from_wire,
    next_message,
    slot_bytes,
    state_bytes,
    to_wire,
)
from exactstep.rows.prepared import PreparedDocuments
from exactstep.rows.stream import RowStream

pytestmark = pytest.mark.slow  # processes started and killed: out of the edit loop


def differences(a, b, prefix: str = "") -> list[str]:
    """Every field of two batches (or encoder sides) that is not bitwise the same."""
    return [prefix + f.name for f in dataclasses.fields(a)
            if not equal(getattr(a, f.name), getattr(b, f.name))]


def equal(x, y) -> bool:
    """Bitwise equality: tensors by dtype, shape and value; dataclasses, dicts and
    sequences by their parts; anything else by ``==``."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype and torch.equal(x, y))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x) is type(y) and all(equal(getattr(x, f.name), getattr(y, f.name))
                                          for f in dataclasses.fields(x))
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(equal, x, y))
    return x == y


def gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` ended (no longer exists, or is a zombie) within ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_same_batches_and_cursor_resume_kill_and_close():
    """In-memory examples: bitwise the in-line batches and state, a stream resumed
    from the consumer's state continues like both (a SIGTERM to the child changes
    nothing), the report is the in-line one; close() reaps the child; a child
    killed without a word is a DataError."""
    exs = examples()
    inline, ahead = stream(exs), LoaderProcess(stream(exs), 3)
    try:
        assert ahead.state_dict() == inline.state_dict()  # before the child exists
        for _ in range(12):
            assert differences(inline.next_batch(), ahead.next_batch()) == []
            assert ahead.state_dict() == inline.state_dict()  # the consumer's, not the child's
        # a SIGTERM to the process group is the parent's stop request: the child goes on
        os.kill(ahead.process.pid, signal.SIGTERM)
        resumed = stream(exs)
        resumed.load_state_dict(ahead.state_dict())
        for _ in range(5):
            expected = inline.next_batch()
            assert differences(resumed.next_batch(), expected) == []
            assert differences(ahead.next_batch(), expected) == []
        assert ahead.report() == inline.report()  # R4 counts of what was consumed
        pid = ahead.process.pid
        assert ahead.process.exitcode is not None  # joined
        assert not Path(f"/proc/{pid}").exists()  # and reaped: no zombie left

        killed = LoaderProcess(stream(exs), 2)
        killed.next_batch()
        os.kill(killed.process.pid, signal.SIGKILL)
        with pytest.raises(DataError, match=r"loader process ended \(exit code -9\)"):
            for _ in range(4):  # the batches already sent may still arrive first
                killed.next_batch()
        killed.close()
    finally:
        ahead.close()


def test_negative_control_the_states_that_travel_are_ahead_of_the_consumer():
    """The messages waiting in the pipe carry the child's later states: taking the
    newest one as the cursor (what a loader without snapshots would checkpoint) would
    skip data; the consumer's state is the in-line one."""
    exs = examples()
    inline, ahead = stream(exs), LoaderProcess(stream(exs), 3)
    try:
        for _ in range(4):
            inline.next_batch(), ahead.next_batch()
        reader = ahead._channel.reader
        waiting = []
        for _ in range(3):  # the child refills to depth = 3 batches ahead
            assert reader.poll(20.0)
            _, (k, _), state = pickle.loads(reader.recv_bytes())
            blob = state_bytes(state, ahead._channel.slot(k))
            waiting.append(pickle.loads(blob).state_dict())
        assert ahead.state_dict() == inline.state_dict()
        assert waiting[-1] != inline.state_dict()
        assert waiting[-1]["batches"] == inline.state_dict()["batches"] + 3
    finally:
        ahead.close()


def test_a_finite_stream_ends_and_an_r7_refusal_arrives_at_its_batch():
    exs = examples(6)
    inline = list(stream(exs, repeat=False))
    ahead = LoaderProcess(stream(exs, repeat=False), 2)
    got = list(ahead)
    assert len(got) == len(inline)
    assert all(differences(a, b) == [] for a, b in zip(got, inline, strict=True))
    assert ahead.next_batch() is None
    ahead.close()

    bad = examples(8)
    bad[5] = Example(5, np.array([1, 2, 999], dtype=np.int64))  # outside the vocabulary
    inline_bad = stream(bad, shuffle=False)
    n_ok = 0
    with pytest.raises(BatchInvariantError) as expected:
        while True:
            inline_bad.next_batch()
            n_ok += 1
    ahead_bad = LoaderProcess(stream(bad, shuffle=False), 2)
    try:
        for _ in range(n_ok):
            ahead_bad.next_batch()
        with pytest.raises(BatchInvariantError) as raised:
            ahead_bad.next_batch()
        assert type(raised.value) is BatchInvariantError
        assert str(raised.value) == str(expected.value)
        before = stream(bad, shuffle=False)
        for _ in range(n_ok):
            before.next_batch()
        assert ahead_bad.state_dict() == before.state_dict()  # after the last good batch
    finally:
        ahead_bad.close()


def test_loading_a_cursor_after_the_child_started_is_refused():
    exs = examples()
    ahead, inline = LoaderProcess(stream(exs), 2), stream(exs)
    for _ in range(3):
        inline.next_batch()
    ahead.load_state_dict(inline.state_dict())  # before the first batch: the child starts there
    try:
        assert differences(ahead.next_batch(), inline.next_batch()) == []
        with pytest.raises(RuntimeError, match="before the first batch"):
            ahead.load_state_dict(inline.state_dict())
    finally:
        ahead.close()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    from exactstep.bench.loader import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("prepared") / "corpus", 1, seed=3)


PREPARED_CFG = BatchConfig(seq_len=64, rows=4, buffer=16)


def prepared_stream(path: Path) -> RowStream:
    from exactstep.bench.loader import BLOCK

    docs = PreparedDocuments(open_prepared(path).splits["train"], BLOCK)
    return RowStream(docs, PREPARED_CFG, pad_id=258, seed=7, vocab_size=259)


def test_a_prepared_stream_pickles_as_file_names_not_tokens(prepared):
    """Pickling the stream maps the shards again by name: the pickle is far smaller
    than the corpus (1 MB of tokens), and the copy continues bitwise. Negative control:
    a shard that does not know its files pickles its whole token array."""
    s = prepared_stream(prepared)
    for _ in range(3):
        s.next_batch()
    tokens = s.examples.split.shards[0].tokens.nbytes
    blob = pickle.dumps(s)
    assert tokens > 1_000_000 and len(blob) < 64_000
    copy = pickle.loads(blob)
    assert copy.state_dict() == s.state_dict()
    for _ in range(4):
        assert differences(copy.next_batch(), s.next_batch()) == []
    shard = s.examples.split.shards[0]
    assert len(pickle.dumps(dataclasses.replace(shard, files=None))) > tokens


def test_a_rank_shard_pickles_with_its_rank_and_settings():
    """D3: each rank's loader gets its own shard of the order. A stream of rank 1 of 3
    (unshuffled, finite) pickled mid-epoch continues bitwise as
    the original, to its end. Negative control: the same position loaded into rank 0's
    stream is refused (the packer state names the rank it was saved with)."""
    exs = examples(60)
    kw = dict(rank=1, world=3, shuffle=False, repeat=False)
    original = stream(exs, **kw)
    for _ in range(2):
        original.next_batch()
    copy = pickle.loads(pickle.dumps(original))
    assert copy.state_dict() == original.state_dict()
    rest = list(original)
    assert rest and all(differences(a, b) == [] for a, b in zip(list(copy), rest, strict=True))
    other = stream(exs, rank=0, world=3, shuffle=False, repeat=False)
    with pytest.raises(ResumeError, match=r"rank \(saved 1, now 0\)"):
        other.load_state_dict(pickle.loads(pickle.dumps(stream(exs, **kw))).state_dict())


def test_a_prepared_stream_through_the_loader_process(prepared):
    inline, ahead = prepared_stream(prepared), LoaderProcess(prepared_stream(prepared), 2)
    try:
        for _ in range(10):
            assert differences(inline.next_batch(), ahead.next_batch()) == []
            assert ahead.state_dict() == inline.state_dict()
        assert ahead.report() == inline.report()
    finally:
        ahead.close()


def test_a_batch_too_large_for_its_slot_crosses_whole(prepared):
    """The slot fallback: a batch that does not fit travels pickled, bitwise the same."""
    s = prepared_stream(prepared)
    batch = s.next_batch()
    small = np.zeros(1024, np.uint8)
    with pytest.raises(OverflowError):
        to_wire(batch, small)
    assert differences(from_wire(pickle.loads(pickle.dumps(to_wire(batch)))), batch) == []
    assert slot_bytes(s) > sum(t.nbytes for t in (batch.input_ids, batch.labels,
                                                  batch.position_ids, batch.segment_ids))


class OneSlot:
    """A ``Channel`` stand-in for ``next_message``: one slot of ``size`` bytes."""

    def __init__(self, size: int) -> None:
        self.slots = SimpleNamespace(count=1)
        self.memory = np.zeros(size, np.uint8)

    def slot(self, k: int) -> np.ndarray:
        return self.memory


def test_the_state_crosses_in_the_slot_or_else_in_the_message(prepared):
    """The child puts the pickled state after the batch in the slot when there is
    room (the message then holds a ``Slab``) and in the message otherwise; either
    way the parent reads the state the stream had right after the batch."""
    s, inline = prepared_stream(prepared), prepared_stream(prepared)
    roomy = OneSlot(slot_bytes(s))
    kind, (k, wire), state = next_message(s, roomy, 0)
    assert kind == "batch" and k == 0 and isinstance(state, Slab)
    assert differences(from_wire(wire, roomy.memory), inline.next_batch()) == []
    assert pickle.loads(state_bytes(state, roomy.memory)).state_dict() == inline.state_dict()
    tight = OneSlot(wire.extent + 64)  # the batch fits, its state does not
    kind, (k, wire), state = next_message(s, tight, 0)
    assert k == 0 and isinstance(state, bytes)
    assert differences(from_wire(wire, tight.memory), inline.next_batch()) == []
    assert pickle.loads(state_bytes(state, None)).state_dict() == inline.state_dict()


@pytest.mark.parametrize("name", sorted(BUILT))
def test_every_family_stream_pickles_and_its_batches_cross_the_wire(name):
    """Each built family (R8): its stream (compiler included) pickles and the copy
    continues bitwise; each batch, every optional field included, comes back from the
    wire (through a slot, then through pickle) bitwise."""
    cfg = resolve(load_config(None, [f"objective.family={name}", "data.max_docs=40",
                                     "data.val_fraction=0.3", "batch.rows=2",
                                     "batch.seq_len=48"]))
    parts = open_family(cfg)
    s = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id, seed=1,
                  vocab_size=parts.tokenizer.vocab_size, compiler=parts.compiler)
    s.next_batch()
    copy = pickle.loads(pickle.dumps(s))
    for _ in range(3):
        batch = s.next_batch()
        assert differences(copy.next_batch(), batch) == []
        slot = np.zeros(slot_bytes(s), np.uint8)
        wire = pickle.loads(pickle.dumps(to_wire(batch, slot)))
        assert differences(from_wire(wire, slot.copy()), batch) == []


@pytest.mark.parametrize("name", ["chat", "mlm"])
def test_a_family_stream_through_the_loader_process(name):
    cfg = resolve(load_config(None, [f"objective.family={name}", "data.max_docs=40",
                                     "data.val_fraction=0.3", "batch.rows=2",
                                     "batch.seq_len=48"]))
    parts = open_family(cfg)

    def make() -> RowStream:
        return RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id, seed=1,
                         vocab_size=parts.tokenizer.vocab_size, compiler=parts.compiler)

    inline, ahead = make(), LoaderProcess(make(), 2)
    try:
        for _ in range(5):
            assert differences(inline.next_batch(), ahead.next_batch()) == []
            assert ahead.state_dict() == inline.state_dict()
    finally:
        ahead.close()


ORPHAN_SCRIPT = r"""
import os, signal, sys
import numpy as np
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.loader_process import LoaderProcess
from exactstep.rows.stream import RowStream

if __name__ == "__main__":
    rng = np.random.default_rng(0)
    exs = [Example(i, rng.integers(0, 256, 20)) for i in range(40)]
    s = RowStream(exs, BatchConfig(seq_len=16, rows=2, buffer=8), pad_id=258, seed=5)
    loader = LoaderProcess(s, 2)
    loader.next_batch()
    print(loader.process.pid, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    # "exit": leave without close()
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_loader_outlives_its_parent(tmp_path, how):
    """A parent that exits without close(), or is SIGKILLed, leaves no loader behind
    (the child watches its parent) and does not hang at interpreter exit."""
    script = tmp_path / "parent.py"
    script.write_text(ORPHAN_SCRIPT)
    # a real process: its exit and its loader child's end are what this test checks
    done = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == (-signal.SIGKILL if how == "kill" else 0), done.stderr
    child = int(done.stdout.split()[0])
    assert gone(child)
