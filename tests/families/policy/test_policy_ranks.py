"""Q1, Q4, D5 for the policy family: a window of eight prompts over two gloo ranks (four
each) samples the same tokens and steps with the same gradient as the same window in
one process, within twice the one-process fp32 gradient's distance from the same window
in float64 (the tolerance of ``test_policy_run``'s micro-batch splits); rank 0's
journal records holds both ranks' samples, and the ledger's figures count them all.
Negative control: a rank that normalised by its own share of the window (D local,
the bug of public trainers under data parallelism) is outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch
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

from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown
from exactstep.parallel.reducer import build_reducer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

pytestmark = pytest.mark.slow

SETTINGS = {**TINY_POLICY, "policy.reward": "token_f1", "policy.baseline": "none",
            "generation.samples": 2}
IDS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def config(**extra):
    return resolve(load_config(None, [f"{k}={v}" for k, v in {**SETTINGS, **extra}.items()]))


class LocalD(UpdateEngine):
    """WRONG (Q4, D1): each rank normalises by its own share of the window."""

    def _global_totals(self, denominator, tokens, signal):
        return denominator, tokens, signal


def length_reward(program) -> None:
    """The response's length: a reward that varies, so the window trains."""
    from exactstep.families.policy.rewards import Reward

    program.reward = Reward("length", lambda s: float(len(s.content(s.response))),
                            {"name": "length", "kind": "test"}, False)


def rank_window(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank: join, run the window on its share of the prompts, save what it saw."""
    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(timeout_s=60.0), "cpu",
                           env=launcher_env(rank, world, port))
    try:
        cfg = config()
        parts = open_family(cfg)
        model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
        program = parts.family.program(cfg, parts, model, torch.device("cpu"))
        length_reward(program)
        update, optimizer, grads = gradient_capture(cfg, model)
        engine_cls = LocalD if job.get("local_d") else UpdateEngine
        engine = engine_cls(model, optimizer, build_schedule(update, 1),
                            Precision(cfg.numerics, "cpu"), update, cfg.objective,
                            device="cpu", pad_id=parts.tokenizer.pad_id,
                            reducer=build_reducer(ctx), plan=parts.family.plan(cfg, rank),
                            program=program)
        distribute_engine(engine, ctx, ParallelConfig())
        seen = []
        prepare = program.prepare
        program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
        disposition = engine.run_window(window_of(parts, [IDS[rank]]), 0)
        torch.save({"grads": grads[0], "tokens": sampled_tokens(seen[0][0]),
                    "records": program.records, "info": disposition.inputs},
                   f"{out}/rank{rank}.pt")
    finally:
        shutdown(ctx)


def test_two_ranks_sample_and_step_as_one_process(tmp_path):
    results, codes, _ = spawn_ranks(rank_window, 2, tmp_path, {}, deadline_s=240)
    assert codes == [0, 0], results
    cfg = config()
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    length_reward(program)
    single, batches = one_window(cfg, parts, model, [IDS[0] + IDS[1]], program=program)
    # Q1: the same samples, wherever each prompt was
    assert sorted(results[0]["tokens"] + results[1]["tokens"]) == sorted(sampled_tokens(batches))
    # the journal and the ledger count the whole window on every rank
    assert results[0]["records"] == results[1]["records"] == program.records
    assert results[0]["info"]["samples"] == 16
    # Q4, D5: the synchronised gradient is the one-process gradient
    exact, _ = one_window(cfg, parts, model, [IDS[0] + IDS[1]],
                          program=Replay([b.map(lambda t: t) for b in batches]),
                          dtype=torch.float64)
    tolerance = spread_tolerance(single, exact)
    for rank in (0, 1):
        assert outside(results[rank]["grads"], single, tolerance) == [], rank
    # negative control: each rank normalising by its own share is not the window's update
    (tmp_path / "wrong").mkdir()
    wrong, codes, _ = spawn_ranks(rank_window, 2, tmp_path / "wrong", {"local_d": True},
                                  deadline_s=240)
    assert codes == [0, 0], wrong
    assert outside(wrong[0]["grads"], single, tolerance) != []
