"""U5, U4, Q3: MIXER's curriculum follows the committed-window clock.

Five windows of the engine (``UpdateEngine``, real rollouts, SGD steps) on the tabular
policy of ``test_policy_gradient`` with ``policy.mixer``: ``delta(c) = min(4, 1 + c)``
over a four-token reference, so each window teacher-forces ``4 - delta`` reference
tokens and samples after them. Window 1 is made non-finite (``update.fail_window``) and
skipped, so from window 2 on the committed clock is one behind the window index.

Independent expectation: the clock counted here from the windows' dispositions, the
reference's ``mixer_delta`` and ``mixer_forced`` (``families.policy.reference``); each
window's recorded ``delta``, the teacher-forced tokens of every row (the reference's
prefix, coefficient 1) and the sampled tokens after them (coefficient the advantage,
not 1) are checked against it.

Negative control: the curriculum read at the window index gives another delta at
windows 2 and 3, which the same check would report (the index and the clock are told
apart by this schedule).
"""

from __future__ import annotations

import numpy as np
from families.policy.test_policy_gradient import TabularPolicy, one_token_prompts

from exactstep.families.policy import reference
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.rewards import Reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.policy import policy_plan
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.example import Example
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

P, K, WINDOWS, SKIPPED = 4, 2, 5, 1
REFERENCE = (1, 2, 1, 2)  # each example's reference response, after the prompt (0,)
CURRICULUM = dict(start=1, step=1, every=1, most=4)



def mixer_run():
    """``(dispositions, rows)``: each window's disposition and its trajectory rows as
    ``(scored tokens, coefficients, the window's D)``."""
    model = TabularPolicy(5, positions=8)
    examples = [Example(example_id=i, tokens=np.array([0, *REFERENCE], dtype=np.int64))
                for i in range(P)]
    scored = Reward("first", lambda s: float(s.response[-1] == 1),
                    {"name": "first", "kind": "test"}, False)
    policy = PolicyConfig(over="causal", baseline="none", normalizer="token_mean",
                          mixer=True, delta_start=CURRICULUM["start"],
                          delta_step=CURRICULUM["step"], delta_every=CURRICULUM["every"],
                          delta_max=CURRICULUM["most"])
    program = PolicyRollouts(policy, GenerationConfig(samples=K, max_new_tokens=2), seed=3,
                             seq_len=8, examples=examples, reward=scored, stop_ids=(),
                             decode=lambda ids: " ".join(map(str, ids)))
    seen = []
    prepare = program.prepare
    program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
    cfg = UpdateConfig(lr=0.1, schedule="constant", warmup=0, clip=0.0, weight_decay=0.0,
                       optimizer="sgd", momentum=0.0, fail_window=SKIPPED)
    optimizer, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, WINDOWS),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=0), device="cpu", pad_id=0,
                          plan=policy_plan("token_mean", 1.0), program=program)
    dispositions = [engine.run_window([one_token_prompts(P)], w) for w in range(WINDOWS)]
    rows = []
    for (batch,), _ in seen:
        plan = policy_plan("token_mean", 1.0)([batch], ObjectiveConfig(), allow_empty=True)
        window_rows = []
        for b in range(batch.labels.shape[0]):
            mask = batch.labels[b] != IGNORE_INDEX
            window_rows.append((batch.labels[b][mask].tolist(),
                                batch.meta["policy"].coefficient[b][mask].tolist(),
                                plan.denominator))
        rows.append(window_rows)
    return dispositions, rows


def committed_clocks(dispositions) -> list[int]:
    """The clock each window saw: the windows committed before it."""
    clocks, committed = [], 0
    for d in dispositions:
        clocks.append(committed)
        committed += d.outcome is Outcome.COMMITTED
    return clocks


def test_the_curriculum_follows_the_committed_clock_across_a_skipped_window():
    dispositions, rows = mixer_run()
    outcomes = [d.outcome for d in dispositions]
    assert outcomes[SKIPPED] is Outcome.SKIPPED_NONFINITE
    assert all(o is Outcome.COMMITTED for w, o in enumerate(outcomes) if w != SKIPPED)
    clocks = committed_clocks(dispositions)
    assert clocks == [0, 1, 1, 2, 3]
    deltas = [reference.mixer_delta(c, **CURRICULUM) for c in clocks]
    assert [d.inputs["delta"] for d in dispositions] == deltas
    for window, (delta, window_rows) in enumerate(zip(deltas, rows, strict=True)):
        forced = reference.mixer_forced(REFERENCE, delta)
        assert len(window_rows) == P * K
        for tokens, coefficients, d in window_rows:
            assert d == P * K * (len(forced) + 2)  # token_mean: every scored token
            assert tuple(tokens[:len(forced)]) == forced, (window, tokens)
            assert len(tokens) == len(forced) + 2  # then max_new_tokens sampled (no stop)
            assert coefficients[:len(forced)] == [1.0] * len(forced)
            assert all(c == coefficients[-1] for c in coefficients[len(forced):])
        sampled = [c[-1] for _, c, _ in window_rows]
        rewards = [float(t[-1] == 1) for t, _, _ in window_rows]
        assert sampled == rewards  # baseline none: the advantage is the reward
    # negative control: the window index's curriculum differs where the clock lags
    by_index = [reference.mixer_delta(w, **CURRICULUM) for w in range(WINDOWS)]
    assert [w for w in range(WINDOWS) if by_index[w] != deltas[w]] == [2, 3]
