"""Background loading (P3): the same batches, the same cursor, errors where they happen."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from small_streams import examples, stream

from exactstep.errors import BatchInvariantError
from exactstep.rows.background import BackgroundStream
from exactstep.rows.example import Example


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f))
               for f in ("input_ids", "labels", "position_ids", "segment_ids")) \
        and a.segments == b.segments


@pytest.mark.parametrize("depth", [1, 3])
def test_same_batches_and_the_cursor_of_what_was_consumed(depth):
    exs = examples()
    inline, ahead = stream(exs), BackgroundStream(stream(exs), depth)
    try:
        for _ in range(12):
            assert same(inline.next_batch(), ahead.next_batch())
            # the worker is ahead, but the state is the consumer's: exactly the inline one
            assert ahead.state_dict() == inline.state_dict()
        # a stream resumed from that state continues like both
        resumed = stream(exs)
        resumed.load_state_dict(ahead.state_dict())
        for _ in range(5):
            expected = inline.next_batch()
            assert same(resumed.next_batch(), expected)
            assert same(ahead.next_batch(), expected)
        assert ahead.report() == inline.report()  # R4 counts of what was consumed
    finally:
        ahead.close()


def test_negative_control_the_wrapped_stream_itself_is_ahead():
    """Without the snapshots the checkpointed cursor would be the worker's, batches
    ahead of the consumer: resuming from it would skip data."""
    exs = examples()
    inline, ahead = stream(exs), BackgroundStream(stream(exs), 3)
    try:
        for _ in range(4):
            inline.next_batch(), ahead.next_batch()
        for _ in range(500):  # let the worker fill its queue (it is 3 batches ahead then)
            if ahead._queue.full():
                break
            time.sleep(0.01)
        assert ahead.stream.state_dict() != inline.state_dict()
        assert ahead.state_dict() == inline.state_dict()
    finally:
        ahead.close()


def test_a_finite_stream_ends_and_an_error_arrives_at_its_batch():
    exs = examples(6)
    inline = list(stream(exs, repeat=False))
    ahead = BackgroundStream(stream(exs, repeat=False), 2)
    got = list(ahead)
    assert len(got) == len(inline) and all(same(a, b) for a, b in zip(got, inline, strict=True))
    assert ahead.next_batch() is None
    bad = examples(8)
    bad[5] = Example(5, np.array([1, 2, 999], dtype=np.int64))  # outside the vocabulary
    inline_bad = stream(bad, shuffle=False)
    ahead_bad = BackgroundStream(stream(bad, shuffle=False), 2)
    n_ok = 0
    with pytest.raises(BatchInvariantError):
        while True:
            inline_bad.next_batch()
            n_ok += 1
    for _ in range(n_ok):
        ahead_bad.next_batch()
    with pytest.raises(BatchInvariantError, match="outside the vocabulary"):
        ahead_bad.next_batch()


def test_loading_a_cursor_after_the_worker_started_is_refused():
    ahead = BackgroundStream(stream(examples()), 2)
    state = ahead.state_dict()
    ahead.load_state_dict(state)  # before the first batch: fine
    ahead.next_batch()
    with pytest.raises(RuntimeError, match="before the first batch"):
        ahead.load_state_dict(state)
    ahead.close()


@pytest.mark.slow
def test_a_run_with_background_loading_is_bitwise_the_run_without(tmp_path):
    """Through the runner (P3): the final checkpoint, the ledger and the data report
    are identical with ``train.prefetch = 3`` on the thread, ``train.prefetch = 2`` in
    a loader process (``train.loader = "process"``) and without; and a copy of the
    process run resumed from its window-3 checkpoint with the loader process again
    (presentation keys, not in the manifest) ends bitwise the same."""
    import shutil

    from run_support import TINY, short_texts, write_texts

    from exactstep.config import load_config
    from exactstep.run.continuation import resume
    from exactstep.run.runner import train
    from exactstep.state.compare import state_differences
    from exactstep.state.safetensors_format import load_checkpoint
    from exactstep.state.store import latest_checkpoint

    source = write_texts(tmp_path / "docs.jsonl", short_texts())
    base = [f"{k}={v}" for k, v in TINY.items()] + [
        f"data.source={source}", "data.val_fraction=0.2", "train.steps=6", "update.accum=2",
        "checkpoint.every=3", "checkpoint.keep=5", "train.progress=false"]
    loaders = {"inline": ["train.prefetch=0"], "thread": ["train.prefetch=3"],
               "process": ["train.prefetch=2", "train.loader=process"]}
    outs = {}
    for name, settings in loaders.items():
        out = tmp_path / name
        train(load_config(None, [*base, *settings]), out, progress=False)
        outs[name] = out
    resumed = tmp_path / "resumed"
    shutil.copytree(outs["process"], resumed)
    resume(resumed, from_checkpoint=resumed / "checkpoints" / "window-00000003",
           overrides=loaders["process"], progress=False)
    outs["resumed"] = resumed

    def state(out):
        model, parts = load_checkpoint(latest_checkpoint(out / "checkpoints"))
        return {"model": model, **parts}

    for name in ("thread", "process", "resumed"):
        assert state_differences(state(outs["inline"]), state(outs[name])) == [], name
        for file in ("ledger.jsonl", "data_report.json", "manifest.json"):
            assert (outs["inline"] / file).read_bytes() == (outs[name] / file).read_bytes(), \
                (name, file)
