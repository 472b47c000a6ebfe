"""The compiled data path against the Python it replaced (R3, R4, R5, R7, S2, P2).

- The planner (``rows.packing.PackPlanner``, its buffer a queue per cost in
  ``rows.kernels``) against ``planner_reference.ReferencePlanner``, the sorted-list
  planner written before the kernels: the same rows, the same ``state_dict`` after
  every row (so the same resume), and a state of either loaded into the other
  continues the same, over random corpora (text and chat ownership, over-long
  documents) and every planner setting (property tests).
- The causal kernel (``rows.kernels.CausalFill``, taken for a ``RowPlan`` over
  prepared shards) against the NumPy compiler (``compile_causal_batch`` given the
  same rows as lists), bitwise, for random shards, ownership bits and settings.
  Negative control: the kernel told the other boundary rule disagrees.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_reference import LatestOnTies, ReferencePlanner

from exactstep.data.prepared import PreparedSplit, Shard
from exactstep.errors import BatchInvariantError, DataError
from exactstep.rows.batch import Batch, Segment
from exactstep.rows.causal import compile_causal_batch, compile_plan
from exactstep.rows.compiler import CAUSAL
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch, is_clean, screen_settings
from exactstep.rows.packing import PackPlanner
from exactstep.rows.prepared import PreparedDocuments

PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@st.composite
def planner_cases(draw):
    seq_len = draw(st.integers(2, 20))
    n = draw(st.integers(1, 30))
    lengths = draw(st.lists(st.integers(1, 3 * seq_len), min_size=n, max_size=n))
    ownership = draw(st.sampled_from(["text", "chat", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    examples = []
    for i, length in enumerate(lengths):
        owned = None
        if ownership == "chat" or (ownership == "mixed" and i % 2):
            owned = rng.random(length) < 0.6
        examples.append(Example(i, rng.integers(0, 50, length).astype(np.int64), owned))
    world = draw(st.integers(1, 3))
    kwargs = dict(
        seq_len=seq_len,
        buffer=draw(st.integers(1, 10)),
        overlong=draw(st.sampled_from(["split", "truncate", "drop"])),
        seed=draw(st.integers(0, 1000)),
        shuffle=draw(st.booleans()),
        repeat=draw(st.booleans()),
        rank=draw(st.integers(0, world - 1)),
        world=world,
        overlap_split=draw(st.booleans()),
    )
    if draw(st.booleans()):  # a compiler's charges (docs/design/rows.md, "Charges")
        kwargs["cost"] = lambda length, cap=seq_len: min(cap, length + length // 4)
    return examples, kwargs, draw(st.integers(1, 40))


def build(cls, examples, kwargs):
    """The planner, or the error it refuses the input with."""
    try:
        return cls(examples, **kwargs)
    except DataError as exc:
        return type(exc), str(exc)


def rows_and_states(planner, rows: int) -> list:
    """Each row (or the end, or the error) and the JSON state after it."""
    out = []
    for _ in range(rows):
        try:
            row = planner.next_row()
        except DataError as exc:
            out.append(("error", str(exc)))
            break
        out.append((row, json.dumps(planner.state_dict(), sort_keys=True)))
        if row is None:
            break
    return out


@PROPERTY
@given(planner_cases())
def test_kernel_planner_plans_what_the_python_planner_plans(case) -> None:
    examples, kwargs, rows = case
    kernel, reference = build(PackPlanner, examples, kwargs), build(ReferencePlanner,
                                                                     examples, kwargs)
    if isinstance(reference, tuple):
        assert kernel == reference  # the same refusal
        return
    assert json.dumps(kernel.state_dict()) == json.dumps(reference.state_dict())
    assert rows_and_states(kernel, rows) == rows_and_states(reference, rows)


@PROPERTY
@given(planner_cases(), st.integers(0, 39))
def test_a_state_of_either_planner_resumes_the_other(case, cut: int) -> None:
    """S2 across the two: a state taken after ``cut`` rows by one, loaded into a
    fresh planner of the other kind, continues exactly as the first does."""
    examples, kwargs, rows = case
    if isinstance(build(ReferencePlanner, examples, kwargs), tuple):
        return
    for first, second in ((PackPlanner, ReferencePlanner), (ReferencePlanner, PackPlanner)):
        source = first(examples, **kwargs)
        taken = rows_and_states(source, cut)
        if taken and (taken[-1][0] == "error" or taken[-1][0] is None):
            continue
        resumed = second(examples, **kwargs)
        resumed.load_state_dict(json.loads(json.dumps(source.state_dict())))
        assert rows_and_states(resumed, rows) == rows_and_states(source, rows)


def test_a_planner_breaking_ties_the_other_way_is_told_apart() -> None:
    """Negative control: the comparison above fails for a planner that gives
    best-fit ties to the latest arrival."""
    examples = [Example(i, np.arange(n, dtype=np.int64)) for i, n in
                enumerate([4, 4, 4, 6, 6, 2, 2, 9])]
    kwargs = dict(seq_len=10, buffer=6, overlong="split", seed=1)
    assert (rows_and_states(PackPlanner(examples, **kwargs), 6)
            == rows_and_states(ReferencePlanner(examples, **kwargs), 6))
    assert (rows_and_states(PackPlanner(examples, **kwargs), 6)
            != rows_and_states(LatestOnTies(examples, **kwargs), 6))


def test_pending_pieces_are_listed_in_arrival_order() -> None:
    examples = [Example(i, np.arange(n, dtype=np.int64)) for i, n in
                enumerate([5, 3, 9, 3, 7, 2, 8])]
    kwargs = dict(seq_len=10, buffer=5, overlong="split", seed=1)
    kernel, reference = PackPlanner(examples, **kwargs), ReferencePlanner(examples, **kwargs)
    for _ in range(3):
        assert kernel.next_row() == reference.next_row()
        assert kernel.pending() == reference.pending()
        assert kernel.pending_pieces == reference.pending_pieces > 0


# ------------------------------------------------------------------ the causal kernel


@st.composite
def prepared_cases(draw):
    seq_len = draw(st.integers(2, 24))
    n = draw(st.integers(2, 40))
    shards = draw(st.integers(1, 3))
    chat = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    lengths = rng.integers(1, 2 * seq_len, n)
    bounds = np.linspace(0, n, shards + 1).astype(int)  # an empty part makes no shard
    parts = []
    for k in range(shards):
        part = lengths[bounds[k]: bounds[k + 1]]
        if not len(part):
            continue
        tokens = rng.integers(0, 300, int(part.sum())).astype(np.uint16)
        offsets = np.concatenate([[0], np.cumsum(part)[:-1]]).astype(np.int64)
        owned = rng.random(len(tokens)) < 0.6 if chat else None
        targets = [int(owned[o + 1: o + m].sum()) if chat else int(m - 1)
                   for o, m in zip(offsets, part, strict=True)]
        index = np.stack([offsets, part, np.array(targets, dtype=np.int64)], axis=1)
        parts.append(Shard(tokens, index.astype(np.int64),
                           None if owned is None else np.packbits(owned)))
    split = PreparedSplit(parts, {"min_length": int(lengths.min()),
                                  "max_length": int(lengths.max())})
    docs = PreparedDocuments(split, block=draw(st.integers(1, 9)))
    planner = PackPlanner(docs, seq_len=seq_len, buffer=draw(st.integers(1, 8)),
                          overlong=draw(st.sampled_from(["split", "truncate"])),
                          seed=draw(st.integers(0, 99)))
    settings_ = dict(seq_len=seq_len, pad_id=301,
                     boundary=draw(st.sampled_from(["ignore", "keep"])),
                     positions=draw(st.sampled_from(["reset", "continue"])))
    return docs, planner, settings_, draw(st.integers(1, 4))


def uniform_docs(count: int, length: int, *, seed: int, block: int):
    """One text shard of ``count`` documents of ``length`` random ids below 300, as
    ``PreparedDocuments``, and its tokens."""
    part = np.full(count, length)
    tokens = np.random.default_rng(seed).integers(0, 300, count * length).astype(np.uint16)
    index = np.stack([np.arange(count) * length, part, part - 1], axis=1).astype(np.int64)
    split = PreparedSplit([Shard(tokens, index, None)],
                          {"min_length": length, "max_length": length})
    return PreparedDocuments(split, block=block), tokens


def assert_same_batch(a, b) -> None:
    for name in ("input_ids", "labels", "position_ids", "segment_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x, y), name
    assert a.segments == b.segments
    assert a.weights is None and b.weights is None


@PROPERTY
@given(prepared_cases())
def test_causal_kernel_builds_what_numpy_builds(case) -> None:
    docs, planner, settings_, rows = case
    for _ in range(3):
        plan = planner.next_plan(rows)
        fast = compile_causal_batch(plan, docs, **settings_)
        slow = compile_causal_batch(plan.rows(), docs, **settings_)  # lists: NumPy
        assert_same_batch(fast, slow)


def test_the_kernel_told_the_other_boundary_rule_disagrees() -> None:
    """Negative control: the equality above can fail -- the kernel with the boundary
    rule flipped is not the NumPy compiler's batch."""
    docs, _ = uniform_docs(12, 5, seed=3, block=4)
    plan = PackPlanner(docs, seq_len=16, buffer=6, overlong="split", seed=0).next_plan(2)
    slow = compile_causal_batch(plan.rows(), docs, seq_len=16, pad_id=301, boundary="ignore")
    flipped = compile_plan(plan, docs.kernel_maps(), seq_len=16, pad_id=301,
                           boundary="keep", positions="reset")
    assert not torch.equal(flipped.labels, slow.labels)
    assert torch.equal(flipped.input_ids, slow.input_ids)


@PROPERTY
@given(prepared_cases(), st.sampled_from([None, 300, 150]), st.booleans())
def test_one_call_fills_screens_and_counts_as_the_three_steps_do(case, vocab, check) -> None:
    """The causal compiler's ``batch_maker`` (fill, R7 screen and count in one
    kernel call over prepared shards) against the steps it replaces -- the NumPy
    compiler, ``check_batch`` and a count of the labels in torch: the same batch,
    the same refusal (a vocabulary of 150 is smaller than the shards' ids, so the
    screen must send the batch to the checks that name the violation), the same
    count; with the checks off, no refusal and still the count."""
    docs, planner, settings_, rows = case
    cfg = BatchConfig(seq_len=settings_["seq_len"], rows=rows, boundary=settings_["boundary"],
                      positions=settings_["positions"], check_invariants=check)
    make = CAUSAL.batch_maker(docs, cfg, pad_id=301, weighted=False, vocab_size=vocab)
    fill = docs.kernel_maps().causal_fill(
        cfg.seq_len, 301, cfg.boundary == "keep", cfg.positions == "reset",
        screen_settings(vocab, cfg.boundary, next_token_targets=True))
    for _ in range(3):
        plan = planner.next_plan(rows)
        expected = compile_causal_batch(plan.rows(), docs, **settings_)  # lists: NumPy
        # the screen run a row at a time says what the whole batch's screen says
        assert fill(plan.pieces, plan.row_starts, Segment)[2] == is_clean(
            expected, vocab, cfg.boundary, next_token_targets=True)
        refusal = None
        try:
            check_batch(expected, vocab, cfg.boundary, next_token_targets=True)
        except BatchInvariantError as exc:
            refusal = str(exc)
        try:
            batch, count = make(plan)
        except BatchInvariantError as exc:
            assert check and str(exc) == refusal
            continue
        assert not check or refusal is None
        assert_same_batch(batch, expected)
        assert count == int((expected.labels != -100).sum())


def test_the_screen_in_the_fill_is_the_screen() -> None:
    """The fused call's screen agrees with ``is_clean`` on the batch it wrote, clean
    or not, and without a screen reports nothing clean (so the caller checks)."""
    from exactstep.rows import kernels

    docs, tokens = uniform_docs(6, 7, seed=5, block=3)
    plan = PackPlanner(docs, seq_len=16, buffer=4, overlong="split", seed=0).next_plan(2)
    maps = docs.kernel_maps()
    for vocab in (300, int(tokens.max())):  # the second refuses the largest id
        fill = kernels.CausalFill(maps, 16, 0, False, True, (vocab, True, True))
        (ids, labels, positions, segs), bad, clean, count, segments = fill(
            plan.pieces, plan.row_starts, Segment)
        batch = Batch(ids, labels, positions, segs, segments=segments)
        assert bad == -1 and clean == is_clean(batch, vocab, "ignore", next_token_targets=True)
        assert clean == (vocab == 300)
        assert count == int((labels != -100).sum())
        assert segments == kernels.plan_segments(plan.pieces, plan.row_starts, Segment)
    unscreened = kernels.CausalFill(maps, 16, 0, False, True, None)
    assert unscreened(plan.pieces, plan.row_starts, Segment)[2] is False


def test_the_planner_frame_follows_a_grown_buffer() -> None:
    """The kernels reach the buffer's arrays through its frame: after the slots are
    replaced (grown), a plan still takes the pieces best fit first, earliest on ties."""
    from exactstep.rows import kernels

    seq_len = 10
    settings_ = np.zeros(5, dtype=np.int64)
    settings_[kernels.SEQ_LEN] = seq_len  # FILL_TO 0: never asks for more pieces
    buf = kernels.PieceBuffer(np.arange(seq_len + 1), settings_, capacity=2)
    for example, length in enumerate([6, 3, 4, 2, 5, 4]):
        buf.push(example, 0, length, 0)  # grows twice
    assert buf.slots.shape[1] == 8
    made, needs_help = buf.plan(0, 2, False)
    pieces, starts = buf.planned(made)
    # row 0: 6, then the earliest 4 (example 2); row 1: 5, then the other 4
    assert (made, needs_help) == (2, False) and starts.tolist() == [0, 2, 4]
    assert pieces[kernels.EXAMPLE].tolist() == [0, 2, 4, 5]
    assert pieces[kernels.LENGTH].tolist() == [6, 4, 5, 4]
    assert pieces[kernels.COLUMN].tolist() == [0, 6, 0, 5]
    assert kernels.pending_columns(buf.slots)[1] == [1, 3]  # examples 1 and 3 wait


def test_a_piece_outside_its_document_is_refused_by_both() -> None:
    tokens = np.arange(20, dtype=np.uint16)
    index = np.array([[0, 10, 9], [10, 10, 9]], dtype=np.int64)
    docs = PreparedDocuments(PreparedSplit([Shard(tokens, index, None)],
                                           {"min_length": 10, "max_length": 10}), block=2)
    plan = PackPlanner(docs, seq_len=12, buffer=2, overlong="split", seed=0).next_plan(1)
    plan.pieces[1, 0] = 5  # offset 5 + length 10 runs past the document
    with pytest.raises(IndexError):
        compile_causal_batch(plan, docs, seq_len=12, pad_id=0)
    with pytest.raises(IndexError):
        compile_causal_batch(plan.rows(), docs, seq_len=12, pad_id=0)


# ------------------------------------------------------------- the kernels' guards


def test_an_index_entry_outside_its_shard_is_refused_not_read() -> None:
    """A document index that points past its shard's tokens (a damaged index the
    fingerprint did not cover) is an ``IndexError`` at the kernel, never a read
    outside the memory map."""
    tokens = np.arange(20, dtype=np.uint16)
    index = np.array([[0, 10, 9], [15, 10, 9]], dtype=np.int64)  # the second runs to 25
    docs = PreparedDocuments(PreparedSplit([Shard(tokens, index, None)],
                                           {"min_length": 10, "max_length": 10}), block=2)
    planner = PackPlanner(docs, seq_len=12, buffer=2, overlong="split", seed=0,
                          shuffle=False)
    assert compile_causal_batch(planner.next_plan(1), docs, seq_len=12, pad_id=0).shape == (1, 12)
    with pytest.raises(IndexError, match="outside its document"):
        compile_causal_batch(planner.next_plan(1), docs, seq_len=12, pad_id=0)


def test_kernels_take_only_contiguous_arrays_of_their_type() -> None:
    from exactstep.rows import kernels

    assert kernels.address(np.zeros(4, dtype=np.int64)) > 0
    with pytest.raises(ValueError, match="contiguous int64"):
        kernels.address(np.zeros(8, dtype=np.int64)[::2])
    with pytest.raises(ValueError, match="contiguous int64"):
        kernels.address(np.zeros(4, dtype=np.int32))
    with pytest.raises(ValueError, match="int64 ids"):
        kernels.screen(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64),
                       torch.zeros(2, 3, dtype=torch.int32), 3, 10, True, True)


def test_the_fill_refuses_row_starts_outside_its_plan() -> None:
    """Row starts that do not begin at 0 or do not rise within the plan would make the
    kernel read past the plan: refused before anything is read."""
    from exactstep.rows import kernels

    tokens = np.arange(40, dtype=np.uint16)
    index = np.array([[0, 20, 19], [20, 20, 19]], dtype=np.int64)
    docs = PreparedDocuments(PreparedSplit([Shard(tokens, index, None)],
                                           {"min_length": 20, "max_length": 20}), block=2)
    maps = docs.kernel_maps()
    pieces = np.array([[0, 1], [0, 0], [20, 20], [0, 0], [0, 0]], dtype=np.int64)
    fill = kernels.CausalFill(maps, 24, 0, False, True, None)
    (inputs, *_), bad, _, _, _ = fill(pieces, np.array([0, 1, 2]), Segment)
    assert bad == -1 and inputs[1, :20].tolist() == list(range(20, 40))
    for starts in ([1, 2], [0, 3], [0, 2, 1], []):
        with pytest.raises(ValueError, match="row starts"):
            fill(pieces, np.array(starts, dtype=np.int64), Segment)
    for bad_pieces in (pieces[:4].copy(), pieces.astype(np.int32), pieces[:, ::-1]):
        with pytest.raises(ValueError, match="row kernels need"):
            fill(bad_pieces, np.array([0, 1, 2]), Segment)
    with pytest.raises(TypeError, match="tuple subclass"):
        fill(pieces, np.array([0, 1, 2]), list)


def test_segments_are_built_only_from_a_well_formed_plan() -> None:
    """``plan_segments`` (a C-API function) reads the plan through the buffer
    protocol and refuses, as ``ValueError``, what it cannot read safely; the
    segments it builds are ``Segment``s with the plan's fields in their order."""
    from exactstep.rows import kernels

    pieces = np.arange(15, dtype=np.int64).reshape(5, 3)  # example, offset, length, piece, col
    rows = kernels.plan_segments(pieces, np.array([0, 2, 2, 3]), Segment)
    assert rows == ((Segment(0, 9, 3, 12, 6), Segment(1, 10, 4, 13, 7)), (),
                    (Segment(2, 11, 5, 14, 8),))
    assert all(type(s) is Segment for row in rows for s in row)
    wide = np.arange(30, dtype=np.int64).reshape(5, 6)
    for bad_pieces, bad_starts in [
        (wide[:, ::2], np.array([0, 3])),  # strided
        (pieces.astype(np.int32), np.array([0, 3])),  # another dtype
        (pieces[:4].copy(), np.array([0, 3])),  # not PLAN_FIELDS rows
        (pieces, np.array([0, 4])),  # a row past the plan
        (pieces, np.array([2, 1])),  # decreasing
        (pieces, np.array([-1, 1])),  # before the plan
        (pieces, np.zeros(0, dtype=np.int64)),  # no row starts at all
    ]:
        with pytest.raises(ValueError, match="row kernels need"):
            kernels.plan_segments(bad_pieces, bad_starts, Segment)
    with pytest.raises(TypeError, match="tuple subclass"):
        kernels.plan_segments(pieces, np.array([0, 3]), list)


def test_a_build_from_another_kernels_c_is_refused(tmp_path) -> None:
    """The library records the SHA-256 of the ``kernels.c`` it was built from: the
    file beside the module passes; an edited copy (one byte more, what an update
    without a rebuild looks like) is refused with the fix named."""
    from pathlib import Path

    from exactstep.rows import kernels

    source = Path(kernels.__file__).with_name("kernels.c")
    lib = kernels.compiled_library()
    kernels.check_source(lib, source)
    edited = tmp_path / "kernels.c"
    edited.write_bytes(source.read_bytes() + b"\n")
    with pytest.raises(ImportError, match="built from another kernels.c.*make, or pip"):
        kernels.check_source(lib, edited)
    kernels.check_source(lib, tmp_path / "absent.c")  # a wheel: no source to compare


def test_a_missing_build_is_one_clear_import_error(monkeypatch) -> None:
    import importlib.util

    from exactstep.rows import kernels

    kernels.compiled_library.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    try:
        with pytest.raises(ImportError, match="C compiler"):
            kernels.compiled_library()
    finally:
        monkeypatch.undo()
        kernels.compiled_library.cache_clear()
    assert kernels.compiled_library() is not None
