"""Property tests (hypothesis) over random documents and ownership masks (R1-R5).

For every compiled batch of a finite stream:
- no supervised target crosses a segment boundary (boundary = ignore);
- every supervised row's target is the next token of the same example;
- row ownership equals target ownership shifted by one (l_i = a_(i+1));
- ownership never changes visibility: every token of a segment is in it;
and over the whole stream, supervised rows = owned targets - what the over-long
policy removed (as counted in the report), and every kept token is emitted once.
The same property check is run on wrong compilers and must fail there.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rows_reference import WRONG_COMPILERS, assert_causal_rows, owns

from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.packing import PackPlanner
from exactstep.rows.stream import RowStream, eval_batches

PAD = 258


@st.composite
def examples_strategy(draw) -> list[Example]:
    n = draw(st.integers(1, 10))
    out = []
    for i in range(n):
        length = draw(st.integers(1, 40))
        tokens = np.array(
            draw(st.lists(st.integers(0, 257), min_size=length, max_size=length)), dtype=np.int64
        )
        owned = None
        if draw(st.booleans()):
            owned = np.array(
                draw(st.lists(st.booleans(), min_size=length, max_size=length)), dtype=bool
            )
        out.append(Example(i, tokens, owned))
    return out


configs = st.builds(
    BatchConfig,
    seq_len=st.integers(2, 24),
    rows=st.integers(1, 4),
    buffer=st.integers(1, 8),
    boundary=st.sampled_from(["ignore", "keep"]),
    positions=st.sampled_from(["reset", "continue"]),
    overlong=st.sampled_from(["split", "truncate", "drop"]),
)


def check_row_properties(batch, examples: list[Example], cfg: BatchConfig) -> None:
    labels = batch.labels.numpy()
    segs = batch.segment_ids.numpy()
    supervised = labels != IGNORE_INDEX
    if cfg.boundary == "ignore":
        same_segment_next = np.zeros_like(supervised)
        same_segment_next[:, :-1] = (segs[:, :-1] == segs[:, 1:]) & (segs[:, :-1] > 0)
        assert not (supervised & ~same_segment_next).any(), "supervised cross-segment target"
    by_id = {e.example_id: e for e in examples}
    for b, row in enumerate(batch.segments):
        for s, seg in enumerate(row, start=1):
            example = by_id[seg.example_id]
            assert (segs[b, seg.start : seg.stop] == s).all(), "a token left its segment"
            for k in range(seg.length - 1):
                col, tok = seg.start + k, seg.offset + k
                assert supervised[b, col] == owns(example, tok + 1), "ownership not shifted by one"
                if supervised[b, col]:
                    assert labels[b, col] == example.tokens[tok + 1], "target is not the next token"


def check_stream(batches, examples: list[Example], cfg: BatchConfig, report: dict) -> None:
    emitted: dict[int, list[tuple[int, int]]] = {}
    for batch in batches:
        check_row_properties(batch, examples, cfg)
        for row in batch.segments:
            for seg in row:
                emitted.setdefault(seg.example_id, []).append((seg.offset, seg.length))
    supervised = sum(batch.num_targets() for batch in batches)
    lost = (
        report["split_targets_lost"]
        + report["truncated_targets_lost"]
        + report["dropped_targets_lost"]
    )
    assert supervised == report["targets"] - lost + report["boundary_targets_kept"]
    assert report["supervised_rows"] == supervised
    for example in examples:
        n = len(example)
        kept = (
            n
            if n <= cfg.seq_len or cfg.overlong == "split"
            else (cfg.seq_len if cfg.overlong == "truncate" else 0)
        )
        pieces = sorted(emitted.get(example.example_id, []))
        covered = [t for offset, length in pieces for t in range(offset, offset + length)]
        assert covered == list(range(kept)), "a kept token is missing or repeated"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=examples_strategy(), cfg=configs, seed=st.integers(0, 2**16))
def test_stream_properties(examples: list[Example], cfg: BatchConfig, seed: int) -> None:
    if cfg.overlong == "drop" and all(len(e) > cfg.seq_len for e in examples):
        return  # refused with a DataError, tested elsewhere
    stream = RowStream(examples, cfg, pad_id=PAD, seed=seed, repeat=False, vocab_size=259)
    batches = list(stream)
    check_stream(batches, examples, cfg, stream.report())
    for batch in batches:
        assert_causal_rows(batch, examples, cfg.boundary, cfg.positions, PAD)


def fixed_case() -> tuple[list[Example], BatchConfig]:
    rng = np.random.default_rng(0)
    examples = []
    for i, length in enumerate([9, 5, 14, 3, 7]):
        owned = rng.random(length) < 0.6
        examples.append(Example(i, rng.integers(0, 256, size=length), owned if i % 2 else None))
    return examples, BatchConfig(seq_len=12, rows=2, buffer=4)


def test_properties_hold_on_fixed_case() -> None:
    examples, cfg = fixed_case()
    stream = RowStream(examples, cfg, pad_id=PAD, seed=1, repeat=False)
    check_stream(list(stream), examples, cfg, stream.report())


@pytest.mark.parametrize(
    "name",
    [
        "no shift",
        "double shift",
        "cross-document target",
        "ownership unshifted",
        "segments collapsed",
    ],
)
def test_property_check_rejects_wrong_compiler(name: str) -> None:
    """Negative control: the property check fails on each wrong compiler."""
    examples, cfg = fixed_case()
    planner = PackPlanner(
        examples, seq_len=cfg.seq_len, buffer=cfg.buffer, overlong="split", seed=1, repeat=False
    )
    rows = [row for row in iter(planner.next_row, None)]
    wrong = WRONG_COMPILERS[name](rows, examples, seq_len=cfg.seq_len, pad_id=PAD)
    right = compile_causal_batch(rows, examples, seq_len=cfg.seq_len, pad_id=PAD)
    check_row_properties(right, examples, cfg)
    with pytest.raises(AssertionError):
        check_row_properties(wrong, examples, cfg)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=examples_strategy(), cfg=configs)
def test_eval_batches_score_every_owned_target_once(
    examples: list[Example], cfg: BatchConfig
) -> None:
    """Held-out batches (L5): each owned target of each example is supervised exactly
    once, whatever the training over-long policy, and never across a segment."""
    cfg = BatchConfig(
        seq_len=cfg.seq_len, rows=cfg.rows, buffer=cfg.buffer, positions=cfg.positions
    )
    scored = {e.example_id: np.zeros(len(e), dtype=np.int64) for e in examples}
    for batch in eval_batches(examples, cfg, pad_id=PAD, vocab_size=259):
        check_row_properties(batch, examples, cfg)
        labels = batch.labels.numpy()
        for b, row in enumerate(batch.segments):
            for seg in row:
                for k in range(seg.length - 1):
                    if labels[b, seg.start + k] != IGNORE_INDEX:
                        scored[seg.example_id][seg.offset + k + 1] += 1
    for example in examples:
        want = np.array([j > 0 and owns(example, j) for j in range(len(example))], dtype=np.int64)
        assert (scored[example.example_id] == want).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(examples=examples_strategy(), cfg=configs, seed=st.integers(0, 99), k=st.integers(0, 6))
def test_resume_at_any_batch_is_bitwise(
    examples: list[Example], cfg: BatchConfig, seed: int, k: int
) -> None:
    """S2/S5: the stream resumed from its JSON state after k batches continues with the
    same batches as the uninterrupted stream (repeat=True, across epochs)."""
    if cfg.overlong == "drop" and any(len(e) > cfg.seq_len for e in examples):
        cfg = BatchConfig(seq_len=cfg.seq_len, rows=cfg.rows, buffer=cfg.buffer, overlong="split")
    straight = RowStream(examples, cfg, pad_id=PAD, seed=seed)
    it = iter(straight)
    expected = [next(it) for _ in range(k + 4)]
    first = RowStream(examples, cfg, pad_id=PAD, seed=seed)
    it = iter(first)
    for _ in range(k):
        next(it)
    resumed = RowStream(examples, cfg, pad_id=PAD, seed=seed)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    it = iter(resumed)
    for want in expected[k:]:
        got = next(it)
        assert got.segments == want.segments
        for name in ("input_ids", "labels", "position_ids", "segment_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name))
