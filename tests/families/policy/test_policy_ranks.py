"""Q1, Q4, D5 for the policy family: a window of eight prompts over two gloo ranks (four
each) samples the same tokens and steps with the same gradient as the same window in
one process, within twice the one-process fp32 gradient's distance from the same window
in float64 (the tolerance of ``test_policy_run``'s micro-batch splits); rank 0's
journal records holds both ranks' samples, and the ledger's figures (samples, entropy,
groups and zero-advantage groups) count them all (negative control: one rank's share).
Negative control: a rank that normalised by its own share of the window (D local,
the bug of public trainers under data parallelism) is outside the tolerance.

U4, D1: with ``baseline = moving_average`` and ranks whose shares see other rewards,
three windows on two ranks give every rank the one process's baseline state (checked
also against the journal's rewards) and gradient in each window. Negative control: a
per-rank mean reward (not all-reduced) is caught.
"""

from __future__ import annotations

import copy
import math

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
from exactstep.update.disposition import Outcome
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


#: How far a token's entropy may move when only the batch its row was sampled in changes
#: (each rank samples its own share in one batch, the one process the whole window):
#: ``H(z) = logsumexp(z) - sum_v p_v z_v`` has ``dH = -sum_v p_v (z_v - zbar) dz_v``, so
#: ``|dH| <= delta * (max z - min z)``, ``delta`` the sup-norm change of the fp32 logits.
#: Batch composition changes each logit by rounding only (a few fp32 ulps of the
#: largest, docs/design/generation.md#batched-sampling): below ``2**-21`` of the logits'
#: range relative to ``H`` at these logits (|z| < 8, H > 1 per token), so a record's sum
#: of entropies is within ``2**-20`` of its own value.
ENTROPY_RTOL = 2.0 ** -20


def same_records(got: list[dict], want: list[dict]) -> list[str]:
    """Where two windows' journal records differ: every field exactly (Q1: the same
    draws, rewards and advantages wherever each prompt was sampled), ``entropy_sum``
    within ``ENTROPY_RTOL`` (a diagnostic of the logits, which batching rounds)."""
    if len(got) != len(want):
        return [f"{len(got)} records vs {len(want)}"]
    out = []
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        ha, hb = a.get("entropy_sum"), b.get("entropy_sum")
        rest_a = {k: v for k, v in a.items() if k != "entropy_sum"}
        rest_b = {k: v for k, v in b.items() if k != "entropy_sum"}
        if rest_a != rest_b:
            out.append(f"record {i}: {rest_a} != {rest_b}")
        elif (ha is None) != (hb is None) or (
                ha is not None and abs(ha - hb) > ENTROPY_RTOL * abs(hb)):
            out.append(f"record {i}: entropy_sum {ha} vs {hb}")
    return out


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
    assert results[0]["records"] == results[1]["records"]
    assert same_records(results[0]["records"], program.records) == []
    assert results[0]["info"]["samples"] == 16
    # the entropy and zero-advantage figures are of the whole window, summed over ranks
    figures = program.window_figures(results[0]["records"], 2)  # the gathered window's
    for rank in (0, 1):
        assert {k: results[rank]["info"][k] for k in figures} == figures
    single_figures = program.window_figures(program.records, 2)  # the one process's
    h, h1 = figures.pop("entropy_mean"), single_figures.pop("entropy_mean")
    assert abs(h - h1) <= ENTROPY_RTOL * abs(h1)
    assert figures == single_figures
    assert figures["groups"] == 8
    local = program.window_figures([r for r in program.records if r["example"] in IDS[0]], 2)
    assert local["groups"] == 4 and local["groups"] != figures["groups"]  # control: a share
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


# -- the moving-average baseline over ranks (U4, D1) -----------------------------------

MA_WINDOWS = 3
MA = {"policy.baseline": "moving_average", "policy.decay": 0.5}


def prompt_reward(program) -> None:
    """The response's length plus the prompt's length mod 5: ranks holding other
    prompts see other rewards, so a per-rank mean is another baseline."""
    from exactstep.families.policy.rewards import Reward

    program.reward = Reward("prompt_length", lambda s: float(len(s.content(s.response)))
                            + float(len(s.prompt) % 5), {"name": "prompt_length",
                                                         "kind": "test"}, False)


def local_mean(program) -> None:
    """WRONG (U4, D1): the window's mean reward of this rank's share alone."""
    from exactstep.families.policy.rollouts import PolicyRollouts

    program.global_mean = lambda rewards, reducer: PolicyRollouts.global_mean(program,
                                                                              rewards, None)


def ma_windows(cfg, parts, model, ids, *, reducer=None, rank=0, ctx=None, wrong=False):
    """``MA_WINDOWS`` windows of the prompts ``ids`` (SGD with a step of ~0, so only the
    baseline's state carries over): per window the gradient, the baseline state it used,
    the state after it, the trajectory batches and every rank's records."""
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    prompt_reward(program)
    if wrong:
        local_mean(program)
    update, optimizer, grads = gradient_capture(cfg, model)
    engine = UpdateEngine(model, optimizer, build_schedule(update, MA_WINDOWS),
                          Precision(cfg.numerics, "cpu"), update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id, reducer=reducer,
                          plan=parts.family.plan(cfg, rank), program=program)
    if ctx is not None:
        distribute_engine(engine, ctx, ParallelConfig())
    seen = []
    prepare = program.prepare
    program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
    out = []
    for w in range(MA_WINDOWS):
        disposition = engine.run_window(window_of(parts, [ids]), w)
        assert disposition.outcome is Outcome.COMMITTED
        out.append({"grads": grads[w], "used": disposition.inputs["baseline_state"],
                    "after": program.moving_average, "batches": seen[w][0],
                    "records": list(program.records)})
    return out


def rank_ma(rank: int, world: int, port: int, out: str, job: dict) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(timeout_s=60.0), "cpu",
                           env=launcher_env(rank, world, port))
    try:
        cfg = config(**MA)
        parts = open_family(cfg)
        model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
        result = ma_windows(cfg, parts, model, IDS[rank], reducer=build_reducer(ctx),
                            rank=rank, ctx=ctx, wrong=job.get("local_mean", False))
        torch.save([{k: v for k, v in w.items() if k != "batches"} for w in result],
                   f"{out}/rank{rank}.pt")
    finally:
        shutdown(ctx)


def expected_states(windows, decay: float) -> list[float]:
    """The moving average after each window from the journal's rewards (every rank's):
    the first window's mean, then ``decay * m + (1 - decay) * mean``."""
    states, m = [], None
    for w in windows:
        rewards = [r["reward"] for r in w["records"]]
        mean = math.fsum(rewards) / len(rewards)
        m = mean if m is None else decay * m + (1 - decay) * mean
        states.append(m)
    return states


def test_the_moving_average_over_two_ranks_is_the_one_process_baseline(tmp_path):
    """Every rank's baseline state and gradient in each of three windows equal the one
    process's: the state within the rounding of float64 sums taken in another order
    (``16 * 2**-53`` of the largest reward: a handful of roundings, each at most half an
    ulp of a value no larger), the gradient within ``spread_tolerance``. Negative
    control: a per-rank mean (not all-reduced) is another state and another update."""
    cfg = config(**MA)
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    single = ma_windows(cfg, parts, copy.deepcopy(model), IDS[0] + IDS[1])
    states = expected_states(single, 0.5)
    largest = max(abs(r["reward"]) for w in single for r in w["records"])
    tol_state = 16 * 2.0 ** -53 * largest
    # the ranks' shares see other rewards: a per-rank mean is not the window's
    for w in single:
        share = [[r["reward"] for r in w["records"] if r["example"] in ids] for ids in IDS]
        assert math.fsum(share[0]) / len(share[0]) != math.fsum(share[1]) / len(share[1])
    assert single[0]["used"] is None
    assert [w["used"] for w in single[1:]] == [w["after"] for w in single[:-1]]
    assert all(abs(w["after"] - s) <= tol_state for w, s in zip(single, states, strict=True))
    tolerances = []
    for w in single:
        exact, _ = one_window(cfg, parts, model, [IDS[0] + IDS[1]],
                              program=Replay([b.map(lambda t: t) for b in w["batches"]]),
                              dtype=torch.float64)
        tolerances.append(spread_tolerance(w["grads"], exact))

    def differences(ranks) -> list[str]:
        bad = []
        for rank, result in enumerate(ranks):
            for w, (got, want, tol) in enumerate(zip(result, single, tolerances, strict=True)):
                if (got["used"] is None) != (want["used"] is None) or (
                        got["used"] is not None and abs(got["used"] - want["used"]) > tol_state):
                    bad.append(f"rank {rank} window {w}: state used {got['used']} vs "
                               f"{want['used']}")
                if abs(got["after"] - want["after"]) > tol_state:
                    bad.append(f"rank {rank} window {w}: state {got['after']} vs "
                               f"{want['after']}")
                bad += [f"rank {rank} window {w}: gradient {n}"
                        for n in outside(got["grads"], want["grads"], tol)]
        return bad

    results, codes, _ = spawn_ranks(rank_ma, 2, tmp_path, {}, deadline_s=240)
    assert codes == [0, 0], results
    assert differences(results) == []
    # negative control: each rank's own mean is another baseline after the first commit
    (tmp_path / "wrong").mkdir()
    wrong, codes, _ = spawn_ranks(rank_ma, 2, tmp_path / "wrong", {"local_mean": True},
                                  deadline_s=240)
    assert codes == [0, 0], wrong
    found = differences(wrong)
    assert any("window 0: state" in f for f in found)  # the first commit's state
    assert any("window 2: gradient" in f for f in found)  # and the update that used it
