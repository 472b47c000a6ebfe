"""RowStream: the packing plan (R4), sharding (D3), exact resume (S2, S5), eval coverage."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from planner_reference import ReferencePlanner

from exactstep.errors import DataError, DistributedError, ResumeError
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import ARRIVAL_BITS, PackPlanner
from exactstep.rows.stream import RowStream, eval_batches

PAD, V = 258, 259


def random_examples(n: int, seed: int, mean: float, shape: float = 2.0) -> list[Example]:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.gamma(shape, mean / shape, size=n).astype(np.int64))
    return [
        Example(i, rng.integers(0, 256, size=int(m), dtype=np.int64)) for i, m in enumerate(lengths)
    ]


def same_batches(xs, ys) -> bool:
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys, strict=True):
        for name in ("input_ids", "labels", "position_ids", "segment_ids"):
            if not torch.equal(getattr(x, name), getattr(y, name)):
                return False
        if x.segments != y.segments:
            return False
    return True


def take(stream: RowStream, k: int) -> list:
    it = iter(stream)
    return [next(it) for _ in range(k)]


CFG = BatchConfig(seq_len=64, rows=4, buffer=16)


@pytest.mark.parametrize("k", [0, 1, 5, 13])
def test_resume_continues_bitwise(k: int) -> None:
    """S2/S5: state after k batches, through JSON, into a fresh stream, continues the same."""
    examples = random_examples(60, seed=1, mean=40)
    straight = take(RowStream(examples, CFG, pad_id=PAD, seed=5), k + 12)
    first = RowStream(examples, CFG, pad_id=PAD, seed=5)
    take(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = RowStream(examples, CFG, pad_id=PAD, seed=5)
    resumed.load_state_dict(state)
    assert same_batches(take(resumed, 12), straight[k:])
    take(first, 12)  # the report's counters travel with the state too
    assert resumed.report() == first.report()


def test_resume_negative_control_without_pending_buffer() -> None:
    """Dropping the packer remainder from the state must change the continuation."""
    examples = random_examples(60, seed=1, mean=40)
    straight = take(RowStream(examples, CFG, pad_id=PAD, seed=5), 20)
    first = RowStream(examples, CFG, pad_id=PAD, seed=5)
    take(first, 8)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["planner"]["pending"], "the test needs a non-empty remainder"
    state["planner"]["pending"] = []
    resumed = RowStream(examples, CFG, pad_id=PAD, seed=5)
    resumed.load_state_dict(state)
    assert not same_batches(take(resumed, 12), straight[8:])


def test_resume_refuses_other_settings() -> None:
    examples = random_examples(30, seed=1, mean=40)
    state = RowStream(examples, CFG, pad_id=PAD, seed=5).state_dict()
    other = RowStream(examples, CFG, pad_id=PAD, seed=6)
    with pytest.raises(ResumeError, match="seed"):
        other.load_state_dict(state)


def test_same_seed_same_batches_other_seed_other_order() -> None:
    examples = random_examples(80, seed=2, mean=30)
    a = take(RowStream(examples, CFG, pad_id=PAD, seed=11), 10)
    b = take(RowStream(examples, CFG, pad_id=PAD, seed=11), 10)
    c = take(RowStream(examples, CFG, pad_id=PAD, seed=12), 10)
    assert same_batches(a, b)
    assert not same_batches(a, c)


def emitted_ids(stream: RowStream) -> list[int]:
    return [
        seg.example_id
        for batch in stream
        for row in batch.segments
        for seg in row
        if seg.piece == 0
    ]


def test_finite_stream_emits_every_example_once_and_ends_short() -> None:
    examples = random_examples(50, seed=3, mean=30)
    stream = RowStream(examples, CFG, pad_id=PAD, seed=0, repeat=False)
    batches = list(stream)
    ids = [s.example_id for b in batches for row in b.segments for s in row if s.piece == 0]
    assert sorted(ids) == list(range(50))
    assert all(b.shape == (4, 64) for b in batches[:-1])
    assert 1 <= batches[-1].shape[0] <= 4
    report = stream.report()
    assert report["real_tokens"] == sum(len(e) for e in examples)
    assert report["supervised_rows"] == report["targets"] - report["split_targets_lost"]


def test_epochs_do_not_mix_and_each_is_a_permutation() -> None:
    examples = random_examples(20, seed=4, mean=20)
    stream = RowStream(examples, BatchConfig(seq_len=64, rows=1, buffer=8), pad_id=PAD, seed=9)
    ids, epochs = [], []
    for batch in stream:
        ids.extend(s.example_id for row in batch.segments for s in row if s.piece == 0)
        if len(ids) >= 60:
            break
    for epoch in range(3):
        assert sorted(ids[20 * epoch : 20 * epoch + 20]) == list(range(20)), epoch
        epochs.append(ids[20 * epoch : 20 * epoch + 20])
    assert epochs[0] != epochs[1]  # a new permutation per epoch


def test_ranks_shard_the_permutation_disjointly() -> None:
    """D3: shards of one epoch are disjoint and cover every example."""
    examples = random_examples(41, seed=5, mean=25)
    shards = [
        set(
            emitted_ids(RowStream(examples, CFG, pad_id=PAD, seed=3, repeat=False, rank=r, world=3))
        )
        for r in range(3)
    ]
    assert set.union(*shards) == set(range(41))
    assert sum(map(len, shards)) == 41
    with pytest.raises(DistributedError):
        RowStream(examples, CFG, pad_id=PAD, seed=3, rank=3, world=3)


class NextFitPlanner(ReferencePlanner):
    """A deliberately naive packer: pieces in arrival order, the row closes as soon as
    the next piece does not fit (used as a negative control)."""

    def next_row(self):
        self._refill()
        if not self._keys:
            return None
        row, space = [], self.seq_len
        while self._pending:
            arrival = min(self._pending)
            piece = self._pending[arrival]
            if piece.length > space:
                break
            del self._pending[arrival]
            self._keys.remove(piece.length << ARRIVAL_BITS | arrival)
            row.append(piece)
            space -= piece.length
        self.counts.rows += 1
        self.counts.real_tokens += self.seq_len - space
        return row


def padding_only_where_nothing_fits(planner: PackPlanner) -> int:
    """Drain ``planner``; assert that every row closed with free space had no buffered
    piece that fits it (R4). Returns how many rows were closed with free space."""
    closed_with_space = 0
    while (row := planner.next_row()) is not None:
        space = planner.seq_len - sum(p.length for p in row)
        pending = [piece.length for piece in planner.pending()]
        assert all(length > space for length in pending), "padding where a piece fits"
        closed_with_space += space > 0
    return closed_with_space


def planner_for(cls, seed: int = 6):
    examples = random_examples(300, seed=seed, mean=50)
    return cls(examples, seq_len=128, buffer=32, overlong="split", seed=0, repeat=False)


def test_padding_only_where_no_pending_piece_fits() -> None:
    """R4: a row is closed with free space only when no buffered piece fits it."""
    assert padding_only_where_nothing_fits(planner_for(PackPlanner)) > 0  # exercised


def test_padding_check_rejects_next_fit() -> None:
    with pytest.raises(AssertionError, match="padding where a piece fits"):
        padding_only_where_nothing_fits(planner_for(NextFitPlanner))


def test_efficiency_on_gamma_lengths() -> None:
    """R4: efficiency (real tokens / slots) >= 0.99 on gamma-distributed lengths."""
    examples = random_examples(3000, seed=7, mean=300, shape=2.0)
    stream = RowStream(
        examples, BatchConfig(seq_len=1024, rows=8, buffer=512), pad_id=PAD, seed=0, repeat=False
    )
    for _ in stream:
        pass
    assert stream.report()["efficiency"] >= 0.99


def test_eval_batches_cover_every_target_exactly_once() -> None:
    """Held-out loss sees every owned target once, over-long examples included (L5)."""
    examples = random_examples(40, seed=8, mean=90)
    cfg = BatchConfig(seq_len=64, rows=4, overlong="drop")  # the eval path ignores drop
    covered = {e.example_id: np.zeros(len(e), dtype=int) for e in examples}
    for batch in eval_batches(examples, cfg, pad_id=PAD, vocab_size=V):
        for b, row in enumerate(batch.segments):
            for seg in row:
                for k in range(seg.length):
                    if int(batch.labels[b, seg.start + k]) != -100:
                        covered[seg.example_id][seg.offset + k + 1] += 1
    for example in examples:
        assert covered[example.example_id][0] == 0
        assert (covered[example.example_id][1:] == 1).all()
    again = list(eval_batches(examples, cfg, pad_id=PAD))
    assert same_batches(again, list(eval_batches(examples, cfg, pad_id=PAD)))


def test_nothing_to_pack_is_a_data_error() -> None:
    with pytest.raises(DataError, match="no examples"):
        RowStream([], CFG, pad_id=PAD, seed=0)
    too_long = random_examples(3, seed=9, mean=500)
    with pytest.raises(DataError, match="overlong"):
        RowStream(too_long, BatchConfig(seq_len=8, rows=1, overlong="drop"), pad_id=PAD, seed=0)
    with pytest.raises(DataError, match="no tokens"):
        RowStream([Example(4, np.zeros(0, dtype=np.int64))], CFG, pad_id=PAD, seed=0)


def test_a_snapshot_keeps_the_state_of_its_moment() -> None:
    """``RowStream.snapshot()`` (what the loaders keep per batch) gives, however far
    the stream runs on, the ``state_dict`` of the moment it was taken (S2).
    Negative control: a snapshot holding the live buffer instead of a copy drifts."""
    import dataclasses

    stream = RowStream(random_examples(60, seed=8, mean=20), CFG, pad_id=PAD, seed=2)
    for _ in range(3):
        stream.next_batch()
    snap = stream.snapshot()
    then = json.dumps(stream.state_dict(), sort_keys=True)
    live = dataclasses.replace(snap.planner, slots=stream.planner._buf.slots)
    for _ in range(5):
        stream.next_batch()
    assert json.dumps(snap.state_dict(), sort_keys=True) == then
    assert json.dumps(stream.state_dict(), sort_keys=True) != then
    assert json.dumps(live.state_dict(), sort_keys=True) != json.dumps(
        snap.planner.state_dict(), sort_keys=True)
