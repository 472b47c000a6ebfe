"""``model.attention = "auto"`` on the CPU weighs the dense mask against per-document
SDPA at the run's thread count (issue 28 item 3; R3, U7, S9).

- The choice is a pure function of the batch's segment layout and the thread count
  (host data): an equal layout with other tokens chooses the same, and the choice
  follows the cost model written out here from docs/design/model.md#auto-on-cpu.
- It changes with the thread count where the model says so, and a resume that
  restores the recorded thread count (S9) makes the same choices again.
- Whatever it picks realises the same visibility (dense to 1e-5), also through the
  ``attend`` layout ``[B, heads, T, D]`` other attention callers use.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import contract_tolerance
from model_batches import fill_rows, packed_batch

from exactstep.model import attention as attn
from exactstep.model import decoder as decoder_module
from exactstep.model.attention import attend, prepare_visibility, resolve_impl
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.state import environment

CPU = torch.device("cpu")
TOL = 1e-5  # R3, fp32: outputs and gradients O(1), rounded to ~1e-7 (see contract_tolerance)


def batch_for(rows: list[list[int]], T: int, seed: int = 0, causal: bool = True):
    return packed_batch(fill_rows(rows, 50, seed), T, causal=causal)


def call_cost(threads: int) -> float:
    """The documented per-bucket cost: one thread's, or two's for any count above one."""
    return attn._CALL_COST if threads <= 1 else attn._CALL_COST_THREADED


def document_cost(threads: int) -> float:
    """The documented per-document cost, read the same way."""
    return attn._DOCUMENT_COST if threads <= 1 else attn._DOCUMENT_COST_THREADED


def expected_choice(rows: list[list[int]], T: int, threads: int) -> str:
    """The cost model in words, by brute force over bucket sets (independent of the
    module's dynamic programme): the cheapest bucketing of the documents plus a cost
    per document, against the dense mask's B * T * (T + linear) unless that mask is
    over the cap."""
    import itertools

    lengths = [n for row in rows for n in row]
    distinct = sorted(set(lengths))
    best = float("inf")
    for r in range(len(distinct)):
        for subset in itertools.combinations(distinct[:-1], r):
            buckets = [*subset, distinct[-1]]
            used = {min(b for b in buckets if b >= n) for n in lengths}
            cost = call_cost(threads) * len(used) + sum(
                min(b for b in buckets if b >= n) * (min(b for b in buckets if b >= n)
                                                     + attn._LINEAR_COST) for n in lengths)
            best = min(best, cost)
    dense = len(rows) * T * (T + attn._LINEAR_COST)
    if len(rows) * T * T > attn._DENSE_MAX_PAIRS:
        return "segments"
    return "dense" if dense < best + document_cost(threads) * len(lengths) else "segments"


def equal_rows(length: int, B: int, T: int) -> list[list[int]]:
    """B rows of documents of ``length`` tokens filling T columns (the last clipped)."""
    row = [length] * (T // length) + ([T % length] if T % length else [])
    return [row] * B


# Layouts: (rows, T). Costs by hand (one bucket, then per document) at one / two threads:
#   16 x [4]*64, T=256:  1,024 * 4 * 36 = 147,456; + 30,000 + 1,024 * 500 = 689,456
#                        < 1,179,648 (dense) -> segments; + 300,000 + 1,024 * 1,500 =
#                        1,983,456 > 1,179,648 -> dense at two threads.
#   8 x [8]*128, T=1024: 1,024 * 8 * 40 = 327,680 + 300,000 + 1,536,000 = 2,163,680
#                        < 8,650,752 -> segments at two threads too.
FLIPS = (equal_rows(4, 16, 256), 256)
STAYS = (equal_rows(8, 8, 1024), 1024)


def test_the_cost_model_by_hand_matches_the_worked_examples():
    """The test's own expectation agrees with the figures worked out above."""
    assert [expected_choice(*FLIPS, t) for t in (1, 2, 8)] == ["segments", "dense", "dense"]
    assert [expected_choice(*STAYS, t) for t in (1, 2, 8)] == ["segments"] * 3


def random_layouts(n: int, seed: int = 0) -> list[tuple[list[list[int]], int]]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        B, T = rng.choice([(2, 64), (4, 256), (16, 256), (8, 1024)])
        low = rng.choice([1, 4, 16, 64])
        menu = [min(T, low * rng.choice([1, 2, 3, 4, 8])) for _ in range(4)]  # few lengths
        rows = []
        for _ in range(B):
            lengths, room = [], T
            while room > 0 and (not lengths or rng.random() < 0.9):
                lengths.append(min(rng.choice(menu), room))
                room -= lengths[-1]
            rows.append(lengths)
        out.append((rows, T))
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_auto_on_cpu_picks_what_the_cost_model_says(threads):
    seen = set()
    for rows, T in [FLIPS, STAYS, *random_layouts(25)]:
        if all(row == [T] for row in rows):
            continue  # whole rows: the plain causal path, tested below
        chosen = resolve_impl("auto", CPU, batch=batch_for(rows, T), threads=threads)
        assert chosen == expected_choice(rows, T, threads), (rows, T, threads)
        seen.add(chosen)
    assert "segments" in seen and ("dense" in seen or threads == 1)  # both occur


def test_the_choice_is_a_pure_function_of_layout_and_threads():
    """Other tokens, a rebuilt batch, repeated calls and the thread count in force
    (when none is passed) all give the same choice; no tensor content is read."""
    for rows, T in (FLIPS, STAYS):
        for threads in (1, 2):
            choices = {resolve_impl("auto", CPU, batch=batch_for(rows, T, seed=s),
                                    threads=threads) for s in range(3)}
            assert len(choices) == 1
            batch = batch_for(rows, T)
            with environment.numerics_restored():
                torch.set_num_threads(threads)
                in_force = prepare_visibility(batch, "auto", CPU).impl
            assert in_force == prepare_visibility(batch, "auto", CPU, threads=threads).impl
            assert in_force == choices.pop()


def test_the_choice_changes_with_the_thread_count_where_the_model_says_so():
    flips, stays = batch_for(*FLIPS), batch_for(*STAYS)
    assert [prepare_visibility(flips, "auto", CPU, threads=t).impl for t in (1, 2)] == [
        "segments", "dense"]
    assert [prepare_visibility(stays, "auto", CPU, threads=t).impl for t in (1, 2)] == [
        "segments", "segments"]


def test_a_resume_under_the_recorded_thread_count_chooses_the_same():
    """S9: the thread count is recorded with the run and restored on resume (as the
    runner does, from the record), so the resumed run makes the same choices. Negative
    control: resuming under another count changes a choice."""
    layouts = [FLIPS, STAYS, *random_layouts(8, seed=1)]
    batches = [batch_for(rows, T) for rows, T in layouts]
    with environment.numerics_restored():
        torch.set_num_threads(2)
        record = environment.capture(CPU)
        before = [prepare_visibility(b, "auto", CPU).impl for b in batches]
        torch.set_num_threads(1)  # a fresh process on another default
        elsewhere = [prepare_visibility(b, "auto", CPU).impl for b in batches]
        torch.set_num_threads(int(record["threads"]))  # the resume restores the record
        after = [prepare_visibility(b, "auto", CPU).impl for b in batches]
    assert after == before and "dense" in before
    assert elsewhere != before


def test_tiny_documents_pick_what_the_model_says():
    """All documents one token long. By hand: 16 x 256 of them cost 4,096 * 33 =
    135,168 in one bucket, + 30,000 + 4,096 * 500 = 2,213,168 on one thread, more than
    the dense 1,179,648 (dense, at every count); 8 x 1,024 of them cost 8,192 * 33 +
    300,000 + 8,192 * 1,500 = 12,858,336 > 8,650,752 on two threads (dense) and
    8,192 * 33 + 30,000 + 8,192 * 500 = 4,396,336 on one (segments). Negative control:
    a tiny-document batch is weighed at all (a one-token-row batch is whole rows)."""
    small, large = equal_rows(1, 16, 256), equal_rows(1, 8, 1024)
    assert [resolve_impl("auto", CPU, batch=batch_for(small, 256), threads=t)
            for t in (1, 2)] == ["dense", "dense"]
    assert [resolve_impl("auto", CPU, batch=batch_for(large, 1024), threads=t)
            for t in (1, 2)] == ["segments", "dense"]
    assert [expected_choice(small, 256, t) for t in (1, 2)] == ["dense", "dense"]
    assert [expected_choice(large, 1024, t) for t in (1, 2)] == ["segments", "dense"]
    whole = prepare_visibility(batch_for([[1]] * 4, 1), "auto", CPU, threads=2)
    assert whole.impl == "segments" and whole.whole_rows


def test_auto_weighs_only_causal_rows_of_documents_without_a_prefix():
    """Whole rows keep the plain causal SDPA; bidirectional and prefix batches (not
    calibrated) keep the per-document path; without a batch, and off the CPU, too."""
    rows, T = FLIPS
    assert resolve_impl("auto", CPU, batch=batch_for(rows, T), threads=2) == "dense"
    assert resolve_impl("auto", CPU, batch=batch_for(rows, T, causal=False),
                        threads=2) == "segments"
    prefixed = batch_for(rows, T)
    prefixed = type(prefixed)(**{**prefixed.__dict__,
                                 "prefix_len": torch.ones(16, 64, dtype=torch.long)})
    assert resolve_impl("auto", CPU, batch=prefixed, threads=2) == "segments"
    whole = batch_for([[256]] * 16, 256)
    assert resolve_impl("auto", CPU, batch=whole, threads=2) == "segments"
    assert prepare_visibility(whole, "auto", CPU, threads=2).whole_rows
    assert resolve_impl("auto", CPU, threads=2) == "segments"
    assert resolve_impl("auto", torch.device("cuda"), batch=batch_for(rows, T),
                        threads=2) == "flex"


def test_the_dense_mask_is_capped(monkeypatch):
    """Past ``_DENSE_MAX_PAIRS`` key-query pairs memory decides: per-document SDPA."""
    batch = batch_for(*FLIPS)
    assert resolve_impl("auto", CPU, batch=batch, threads=2) == "dense"
    monkeypatch.setattr(attn, "_DENSE_MAX_PAIRS", 16 * 256 * 256 - 1)
    assert resolve_impl("auto", CPU, batch=batch, threads=2) == "segments"


def test_explicit_segments_keep_their_buckets_at_every_thread_count():
    """... while "auto" sizes its buckets at the thread count: here, by hand, padding
    the 512 eight-token documents to 16 costs 512 * (16 * 48 - 8 * 40) = 229,376, more
    than a bucket on one thread (30,000), less than one on two (300,000)."""
    batch = batch_for([[8] * 64 + [16] * 32] * 8, 1024)
    one, two = (prepare_visibility(batch, "segments", CPU, threads=t) for t in (1, 2))
    assert [b.length for b in one.buckets] == [b.length for b in two.buckets] == [8, 16]
    auto = [prepare_visibility(batch, "auto", CPU, threads=t) for t in (1, 2)]
    assert [v.impl for v in auto] == ["segments", "segments"]
    assert [[b.length for b in v.buckets] for v in auto] == [[8, 16], [16]]


def attention_and_grads(batch, vis, dtype=torch.float32):
    """``attend`` on ``[B, heads, T, D]`` (the layout other callers use), and grads; the
    inputs drawn in fp32, then taken to ``dtype``."""
    B, T = batch.shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, T, 8, generator=g).to(dtype).requires_grad_()
               for _ in range(3))
    out = attend(q, k, v, vis)
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def real_rows(batch, tensors):
    """Real positions only (padding rows are each path's own business)."""
    keep = batch.segment_ids != 0  # [B, T]
    return [t.transpose(1, 2)[keep] for t in tensors]


def test_what_auto_picks_realises_the_same_visibility():
    """Dense when auto picks it is the reference itself (bitwise); per-document with
    the threaded buckets equals it to 1e-5 (or twice dense fp32's own distance from
    float64, were that larger: ``contract_tolerance``). Negative control: the plain
    causal visibility of whole rows, applied to packed rows, is far off."""
    batch = batch_for([[10, 22, 16, 8, 24] * 3 + [16], [12, 20] * 6 + [30]], 256)
    dense = prepare_visibility(batch, "dense", CPU)
    reference = attention_and_grads(batch, dense)
    tol = contract_tolerance(TOL, real_rows(batch, reference), real_rows(
        batch, attention_and_grads(batch, dense, torch.float64)))
    impls = []
    for threads in (1, 2):
        vis = prepare_visibility(batch, "auto", CPU, threads=threads)
        impls.append(vis.impl)
        got = attention_and_grads(batch, vis)
        if vis.impl == "dense":
            assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        for a, b in zip(real_rows(batch, got), real_rows(batch, reference), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=tol)
    assert impls == ["segments", "dense"]  # both paths were checked
    leaky = attn.Visibility(impl="segments", batch_shape=batch.shape, causal=True,
                            whole_rows=True)
    wrong = real_rows(batch, attention_and_grads(batch, leaky))
    assert max((a - b).abs().max().item()
               for a, b in zip(wrong, real_rows(batch, reference), strict=True)) > 1e-2


def test_the_decoder_follows_the_thread_count_in_force(monkeypatch):
    chosen = []
    real = decoder_module.prepare_visibility

    def spy(*args, **kwargs):
        vis = real(*args, **kwargs)
        chosen.append(vis.impl)
        return vis

    monkeypatch.setattr(decoder_module, "prepare_visibility", spy)
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=16), 50, seed=0)
    batch = batch_for(*FLIPS)
    with environment.numerics_restored(), torch.no_grad():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model(batch)
    assert chosen == ["segments", "dense"]
