"""Real processes over gloo: one objective (D1, D5), agreed skips (D2), a dead peer.

All scenarios of one job run in the same two spawned ranks, one after the other
(each phase builds a fresh engine), so the suite pays the process start-up once.
Each promise has its negative control in the same job: a deliberately wrong reducer
that must fail the very check the right one passes.

The communication cadence (D1) is counted on DDP's own collectives: a communication
hook on the DDP-wrapped module records every gradient-bucket all-reduce DDP issues,
with the window and microbatch it happened in.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from workers import build_engine, params_of, rank_main, run_windows, shards, spawn_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

# token counts [rank][window][microbatch]: very unequal; rank 0 has none in window 1,
# rank 1 none in window 3, and window 4 is empty on both ranks (NO_OBJECTIVE).
UNEQUAL = [
    [[12, 3], [0, 0], [5, 16], [1, 0], [0, 0]],
    [[1, 0], [16, 9], [0, 2], [0, 0], [0, 0]],
]
# every rank has some tokens in every window, so the wrong reducer (which decides
# NO_OBJECTIVE per rank) keeps its collectives aligned and can be compared.
UNEQUAL_NONEMPTY = [
    [[12, 3], [1, 0], [5, 16]],
    [[1, 0], [16, 9], [0, 2]],
]
FINITE = [[[6, 2], [3, 3], [4, 0], [2, 5]], [[1, 7], [0, 2], [8, 8], [0, 1]]]
# K = 3 microbatches per window, unequal, one empty microbatch on each rank
K = 3
CADENCE = [[[5, 0, 9], [3, 3, 3], [12, 1, 4]], [[2, 7, 1], [0, 6, 8], [4, 4, 0]]]
FIRST_BUCKET_BYTES = 1024 * 1024  # DDP caps its first gradient bucket at 1 MiB
WORLD = 2


def one_process(token_counts) -> tuple[dict, list[dict]]:
    """The same global windows in one process: rank 0's microbatches, then rank 1's."""
    per_rank = shards(token_counts)
    windows = [sum((per_rank[r][w] for r in range(WORLD)), [])
               for w in range(len(token_counts[0]))]
    engine = build_engine()
    ledger = run_windows(engine, windows)
    return params_of(engine), ledger


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ranks")
    phases = [
        {"windows": shards(UNEQUAL)},
        {"windows": shards(UNEQUAL_NONEMPTY)},
        {"windows": shards(UNEQUAL_NONEMPTY), "reducer": "local_mean"},
        {"windows": shards(FINITE), "fail_window": {1: 2}},
        {"windows": shards(FINITE), "fail_window": {1: 2}, "reducer": "unagreed_finite"},
        {"windows": shards(CADENCE), "count_ddp_collectives": True},
        {"windows": shards(CADENCE), "count_ddp_collectives": True,
         "reducer": "sync_every_microbatch"},
    ]
    results, codes, _ = spawn_ranks(rank_main, WORLD, out, {"phases": phases}, deadline_s=120)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} wrote nothing (exit code {codes[rank]})"
        assert "error" not in result, result.get("traceback", result.get("error"))
    return [{"ranks": [r["phases"][i] for r in results]} for i in range(len(phases))]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_unequal_shards_give_the_one_process_update(job) -> None:
    """D5: R = 2 with very unequal token counts (and empty windows) == one process."""
    reference, ledger = one_process(UNEQUAL)
    for rank in job[0]["ranks"]:
        # D5's fp32 1e-5: ranks reduce the same gradient terms in another order (~1e-7 on these
        # O(1) tiny-model parameters after a few windows), two orders below
        assert max_diff(rank["params"], reference) <= 1e-5
        assert [r["D"] for r in rank["ledger"]] == [r["D"] for r in ledger]
        assert [r["disposition"] for r in rank["ledger"]] == [r["disposition"] for r in ledger]
    assert ledger[-1]["disposition"] == "NO_OBJECTIVE"  # decided over both ranks (L4)


def test_negative_control_mean_of_rank_local_means_fails_d5(job) -> None:
    """The same check, run on ranks that average their local means, must fail."""
    reference, _ = one_process(UNEQUAL_NONEMPTY)
    right = job[1]["ranks"][0]["params"]
    wrong = job[2]["ranks"][0]["params"]
    assert max_diff(right, reference) <= 1e-5  # D5, as above
    assert max_diff(wrong, reference) > 1e-5


def test_window_costs_two_small_collectives(job) -> None:
    """D1: per window one all-reduce of [D, tokens] and one of [flag, S, NLL], nothing
    per microbatch (DDP's own bucket all-reduces are counted separately, below)."""
    windows = len(UNEQUAL_NONEMPTY[0])
    assert job[1]["ranks"][0]["collectives"] == 2 * windows


def bucket_reduces_per_window(calls: list[dict]) -> list[int]:
    counts = Counter(c["window"] for c in calls)
    return [counts[w] for w in range(len(CADENCE[0]))]


def test_gradients_are_all_reduced_once_per_window_not_per_microbatch(job) -> None:
    """D1: with K = 3, DDP reduces its buckets once per window, in the last backward."""
    for rank in job[5]["ranks"]:
        # the tiny model's gradients fit DDP's first bucket: one bucket, one all-reduce
        assert rank["grad_bytes"] < FIRST_BUCKET_BYTES
        assert bucket_reduces_per_window(rank["ddp_calls"]) == [1] * len(CADENCE[0])
        assert {c["microbatch"] for c in rank["ddp_calls"]} == {K - 1}


def test_negative_control_without_no_sync_reduces_k_times_per_window(job) -> None:
    """The same count on ranks that never enter no_sync: K times as many, one set
    after every microbatch (the replicas still agree: only the traffic differs)."""
    for right, wrong in zip(job[5]["ranks"], job[6]["ranks"], strict=True):
        expected = [K * n for n in bucket_reduces_per_window(right["ddp_calls"])]
        assert bucket_reduces_per_window(wrong["ddp_calls"]) == expected
        assert {c["microbatch"] for c in wrong["ddp_calls"]} == set(range(K))
    for phase in (5, 6):
        rank0, rank1 = job[phase]["ranks"]
        assert max_diff(rank0["params"], rank1["params"]) == 0.0


def test_nonfinite_on_one_rank_skips_the_window_everywhere(job) -> None:
    """D2: a NaN injected on rank 1 only: both ranks skip window 2, ledgers agree,
    parameters stay identical across ranks."""
    rank0, rank1 = job[3]["ranks"]
    assert rank0["ledger"][2]["disposition"] == "SKIPPED_NONFINITE"
    assert [r["disposition"] for r in rank0["ledger"]] == [r["disposition"] for r in rank1["ledger"]]
    assert max_diff(rank0["params"], rank1["params"]) == 0.0


def test_negative_control_unagreed_flag_lets_ranks_diverge(job) -> None:
    """Without the all-reduced flag the same checks fail: ledgers and replicas differ."""
    rank0, rank1 = job[4]["ranks"]
    assert [r["disposition"] for r in rank0["ledger"]] != [r["disposition"] for r in rank1["ledger"]]
    assert max_diff(rank0["params"], rank1["params"]) > 0.0


def test_sigkill_of_one_rank_stops_the_job_in_bounded_time(tmp_path) -> None:
    """A rank killed mid-run: the survivor fails with a DistributedError, no hang (D1)."""
    windows = shards([[[4, 4]] * 40, [[4, 4]] * 40])
    job = {"phases": [{"windows": windows, "kill_at": (1, 3)}], "timeout_s": 10.0}
    results, codes, elapsed = spawn_ranks(rank_main, WORLD, tmp_path, job, deadline_s=60)
    assert codes[1] == -9 and results[1] is None
    assert codes[0] is not None, "the surviving rank hung"
    assert results[0] is not None and results[0]["kind"] == "PeerFailure", results[0]  # a DistributedError
    assert "collective failed" in results[0]["error"]
