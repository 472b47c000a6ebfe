"""D1, D2, Q1, Q4 for the policy family when a rank's share of a window holds fewer
examples than the others' or none (the last window of the data, fewer prompts than
ranks): the rank's padding micro-batches (``parallel.agreement.empty_microbatch``,
every segment naming example -1) contribute nothing, and the rank still joins every
collective of the window: the global D, the finite decision, the window's mean reward
(the moving average), the learned baseline's regression and the gathered records.

Two gloo ranks run, in one job, the windows ``SHARES`` (rank 0's and rank 1's
micro-batches; ``None`` a padding micro-batch) under the moving-average and the
learned baselines. Each must give what the same prompts give in one process: the
same samples and records (on both ranks), the same moving average after the commit
(rewards are lengths, so every sum is exact), the regression's token count, and the
gradient within twice the one-process fp32 gradient's distance from float64
(``test_policy_run``'s tolerance).
Negative control: the rollout program without the padding rule (every segment's
example looked up) fails the job with the DataError naming example -1.
"""

from __future__ import annotations

import pytest
import torch
from families.policy.test_policy_ranks import length_reward, same_records
from families.policy.test_policy_run import (
    TINY_POLICY,
    Replay,
    gradient_capture,
    one_window,
    outside,
    sampled_tokens,
    spread_tolerance,
    window_of,
)
from parallel.workers import spawn_ranks

import exactstep.families.policy.rollouts as rollouts
from exactstep.config import load_config
from exactstep.errors import DataError
from exactstep.families import open_family, resolve
from exactstep.parallel.agreement import distribute_engine, empty_microbatch
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown
from exactstep.parallel.reducer import build_reducer
from exactstep.rows.batch import Segment
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

pytestmark = pytest.mark.slow

#: Per window, each rank's micro-batches of example ids; ``None``: a padding one.
SHARES = {
    "shorter": ([[0, 1], [2, 3]], [[4, 5], None]),  # rank 1's share ends first
    "empty": ([[0, 1, 2]], [None]),                  # fewer prompts than ranks
}
BASELINES = ("moving_average", "learned")


def config(baseline: str):
    settings = {**TINY_POLICY, "policy.reward": "token_f1", "policy.baseline": baseline,
                "generation.samples": 2}
    return resolve(load_config(None, [f"{k}={v}" for k, v in settings.items()]))


def old_example_ids(batch, microbatch):
    """WRONG (the crash): every segment's example is a prompt, padding's -1 too."""
    return [seg.example_id for row in batch.segments for seg in row]


def share_batches(cfg, parts, share):
    """A rank's micro-batches: ``window_of``'s prompts, or the real padding micro-batch
    that ``agreed_window`` adds to a shorter share."""
    out = []
    for ids in share:
        if ids is None:
            out.append(empty_microbatch(cfg.batch.rows, cfg.batch.seq_len,
                                        parts.tokenizer.pad_id))
        else:
            out += window_of(parts, [ids])
    return out


def rank_window(ctx, rank: int, shares, baseline: str, out: str) -> dict:
    """One window of this rank's share on a fresh model and program."""
    cfg = config(baseline)
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    length_reward(program)
    update, optimizer, grads = gradient_capture(cfg, model)
    engine = UpdateEngine(model, optimizer, build_schedule(update, 1),
                          Precision(cfg.numerics, "cpu"), update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          reducer=build_reducer(ctx), plan=parts.family.plan(cfg, rank),
                          program=program)
    distribute_engine(engine, ctx, ParallelConfig())
    seen = []
    prepare = program.prepare
    program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
    try:
        disposition = engine.run_window(share_batches(cfg, parts, shares[rank]), 0)
    except DataError as exc:  # the negative control's crash, for the test to read
        torch.save({"error": str(exc)}, f"{out}/rank{rank}.pt")
        raise
    return {"grads": grads[0], "tokens": sampled_tokens(seen[0][0]),
            "records": program.records, "info": disposition.inputs,
            "outcome": disposition.outcome.value, "D": disposition.denominator,
            "moving_average": program.moving_average}


def rank_windows(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: every (window, baseline) of ``SHARES`` x ``BASELINES``, saved."""
    torch.set_num_threads(1)
    if job.get("old"):
        rollouts.example_ids = old_example_ids
    ctx = init_distributed(ParallelConfig(timeout_s=60.0), "cpu",
                           env=launcher_env(rank, world, port))
    try:
        saved = {(name, baseline): rank_window(ctx, rank, shares, baseline, out)
                 for name, shares in SHARES.items() for baseline in BASELINES}
        torch.save(saved, f"{out}/rank{rank}.pt")
    finally:
        shutdown(ctx)


def one_process(name: str, baseline: str) -> dict:
    """The same prompts as one micro-batch per rank share, in one process."""
    cfg = config(baseline)
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    ids = [i for share in SHARES[name] for m in share if m is not None for i in m]
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    length_reward(program)
    single, batches = one_window(cfg, parts, model, [ids], program=program)  # commits
    exact, _ = one_window(cfg, parts, model, [ids],
                          program=Replay([b.map(lambda t: t) for b in batches]),
                          dtype=torch.float64)
    return {"grads": single, "exact": exact, "tokens": sampled_tokens(batches),
            "records": program.records, "moving_average": program.moving_average,
            "D": sum(len(r) for r in sampled_tokens(batches)), "n": len(ids)}


def test_a_rank_with_a_short_or_empty_share_joins_the_window_d2(tmp_path):
    results, codes, _ = spawn_ranks(rank_windows, 2, tmp_path, {}, deadline_s=300)
    assert codes == [0, 0], results
    for name in SHARES:
        for baseline in BASELINES:
            want = one_process(name, baseline)
            ranks = [results[r][name, baseline] for r in (0, 1)]
            where = (name, baseline)
            # Q1: the same samples, wherever each prompt was; padding samples nothing
            assert sorted(ranks[0]["tokens"] + ranks[1]["tokens"]) == sorted(want["tokens"])
            # the gathered records: the whole window's, on every rank
            assert ranks[0]["records"] == ranks[1]["records"], where
            assert same_records(ranks[0]["records"], want["records"]) == [], where
            assert ranks[0]["info"]["samples"] == 2 * want["n"], where
            # D2: one global D, one decision, one window mean for the moving average
            assert ranks[0]["outcome"] == ranks[1]["outcome"] == "COMMITTED", where
            assert ranks[0]["D"] == ranks[1]["D"] == want["D"], where
            if baseline == "moving_average":
                assert ranks[0]["moving_average"] == ranks[1]["moving_average"] \
                    == want["moving_average"] is not None, where
            else:  # the regression saw every sampled token of the window, once
                assert ranks[0]["info"]["baseline_tokens"] == \
                    ranks[1]["info"]["baseline_tokens"] == want["D"], where
            tolerance = spread_tolerance(want["grads"], want["exact"])
            for rank in (0, 1):
                assert outside(ranks[rank]["grads"], want["grads"], tolerance) == [], \
                    (where, rank)


def test_negative_control_padding_looked_up_as_an_example_fails_the_job(tmp_path):
    results, codes, _ = spawn_ranks(rank_windows, 2, tmp_path, {"old": True},
                                    deadline_s=120)
    assert codes[1] not in (0, None)  # rank 1 raised before its first collective
    assert "names example -1" in results[1]["error"]


def test_padding_names_example_minus_one():
    """The padding micro-batch this test feeds is the one the window agreement makes."""
    batch = empty_microbatch(2, 8, 0)
    assert batch.meta["padding"] is True
    assert {seg for row in batch.segments for seg in row} == {Segment(-1, 0, 0, 0, 8)}
