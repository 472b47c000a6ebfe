"""Q3, Q4, U4, S2 for MIXER's learned baseline (``policy.baseline = "learned"``).

- Each sampled token's coefficient is its trajectory's reward minus ``b_t = w . h_t +
  c``, where ``h_t`` is the policy's state *before* the token. Independent expectation:
  the pure-Python reference (``families.policy.reference``) on states computed by hand
  from the tabular policy's tables (``embed[token] + pos[position]``), to float64's
  rounding of the dot products.
- The regressor's loss and gradient are the reference's (a float64 sum bound); its
  first committed Adam step moves each parameter by ``lr`` against its gradient's sign.
- U4: a window that does not commit leaves the regressor (and its optimizer) as it was;
  its state is the program's checkpoint part and loads back bitwise.
- Q1: the baselines of a window split as 1 x 8 and 8 x 1 micro-batches are bitwise
  equal (each prompt's states come from one forward of its own ``K`` rows).
- A run trains it: the ledger's ``baseline_loss`` falls as it learns the rewards.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from families.policy.test_policy_gradient import TARGET, K, TabularPolicy, reward
from families.policy.test_policy_run import TINY_POLICY, one_window, rewards  # noqa: F401

from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.policy import reference
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.rewards import Reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.rows.example import Example
from exactstep.update.disposition import Disposition, Outcome

P = 6
WEIGHT, BIAS = (0.7, -1.1, 0.4), 0.2


def tabular_program(lr: float = 1e-2) -> tuple[TabularPolicy, PolicyRollouts]:
    examples = [Example(example_id=i, tokens=torch.tensor([0, *TARGET]).numpy())
                for i in range(P)]
    scored = Reward("tabular", lambda s: reward(tuple(s.response)),
                    {"name": "tabular", "kind": "test"}, False)
    program = PolicyRollouts(PolicyConfig(over="causal", baseline="learned", regressor_lr=lr),
                             GenerationConfig(samples=K, max_new_tokens=2), seed=3,
                             seq_len=8, examples=examples, reward=scored, stop_ids=(),
                             decode=lambda ids: " ".join(map(str, ids)))
    return TabularPolicy(), program


def preset(program: PolicyRollouts, weight=WEIGHT, bias=BIAS) -> None:
    w = torch.tensor(weight, dtype=torch.float64, requires_grad=True)
    c = torch.tensor([bias], dtype=torch.float64, requires_grad=True)
    program.load_state_dict({"moving_average": None, "regressor": {
        "weight": w.detach(), "bias": c.detach(),
        "optimizer": torch.optim.Adam([w, c], lr=program.policy.regressor_lr).state_dict()}})


def prompts(ids):
    from exactstep.rows.batch import Batch, Segment

    return [Batch(input_ids=torch.zeros((len(m), 1), dtype=torch.int64),
                  labels=torch.full((len(m), 1), -100, dtype=torch.int64),
                  position_ids=torch.zeros((len(m), 1), dtype=torch.int64),
                  segment_ids=torch.ones((len(m), 1), dtype=torch.int32),
                  segments=tuple((Segment(i, 0, 0, 0, 1),) for i in m)) for m in ids]


def closed(outcome: Outcome) -> Disposition:
    return Disposition(window=0, outcome=outcome, cause=None, lr=None, denominator=0.0,
                       loss=None, grad_norm=None, tokens=0)


def by_hand_states(model: TabularPolicy, tokens: list[int]) -> list[list[float]]:
    """The tabular policy's state before each sampled token: the previous token's
    embedding plus the position's row (the prompt is token 0 at position 0), added in
    fp32 as the model does (IEEE addition is correctly rounded: one exact answer)."""
    seq = [0, *tokens]
    embed, pos = model.embed.detach().numpy(), model.pos.detach().numpy()
    return [[float(np.float32(embed[seq[t], v]) + np.float32(pos[t, v])) for v in range(3)]
            for t in range(len(tokens))]


def test_coefficients_are_the_reward_minus_the_regressors_baseline_per_token():
    model, program = tabular_program()
    preset(program)
    batches, info = program.prepare(model, prompts([list(range(P))]), clock=0, window=0,
                                    device=torch.device("cpu"))
    rows = batches[0].meta["policy"]
    labels = batches[0].labels
    assert len(program.records) == P * K
    for b, record in enumerate(program.records):
        tokens = labels[b][labels[b] != -100].tolist()
        states = by_hand_states(model, tokens)
        baselines = tuple(math.fsum(w * x for w, x in zip(WEIGHT, h, strict=True)) + BIAS
                          for h in states)
        want, _ = reference.window_coefficients(
            [[reference.Sample(reward(tuple(tokens)), 0, len(tokens), baselines)]],
            baseline="learned", normalizer="token_mean")
        got = rows.coefficient[b][labels[b] != -100].tolist()
        # float64 dot products of 3 terms plus a bias: 4 roundings of values below 8
        bound = 4 * 2.0 ** -53 * 8
        assert max(abs(g - w) for g, w in zip(got, want[0], strict=True)) <= bound
        assert len(set(baselines)) > 1 or len(tokens) == 1  # a baseline per token
        assert abs(record["baseline"] - math.fsum(baselines) / len(baselines)) <= bound
    assert info["baseline_tokens"] == sum(len(by_hand_states(model, [0] * 2))
                                          for _ in range(P * K))


def test_the_regressors_step_is_its_own_loss_gradient_applied_on_commit_only():
    model, program = tabular_program(lr=0.05)
    preset(program)
    batches, info = program.prepare(model, prompts([list(range(P))]), clock=0, window=0,
                                    device=torch.device("cpu"))
    labels = batches[0].labels
    states, targets = [], []
    for b in range(labels.shape[0]):
        tokens = labels[b][labels[b] != -100].tolist()
        states.append(by_hand_states(model, tokens))
        targets.append(reward(tuple(tokens)))
    loss, grad_w, grad_b = reference.regressor_step(states, targets, WEIGHT, BIAS)
    assert info["baseline_loss"] == pytest.approx(loss, rel=1e-12, abs=0)
    before = program.state_dict()["regressor"]
    # U4: a skipped window drops the pending step
    program.close(closed(Outcome.SKIPPED_NONFINITE))
    after_skip = program.state_dict()["regressor"]
    assert torch.equal(after_skip["weight"], before["weight"])
    assert torch.equal(after_skip["bias"], before["bias"])
    assert after_skip["optimizer"]["state"] == {}
    # the same window committed: Adam's first step (bias-corrected moments g and g^2),
    # lr * g / (|g| + eps) against the gradient, eps = 1e-8; float64 rounding aside
    program.prepare(model, prompts([list(range(P))]), clock=0, window=0,
                    device=torch.device("cpu"))
    program.close(closed(Outcome.COMMITTED))
    moved = program.state_dict()["regressor"]

    def adam(w: float, g: float) -> float:
        return w - 0.05 * g / (abs(g) + 1e-8)

    want = [adam(w, g) for w, g in zip(WEIGHT, grad_w, strict=True)]
    assert moved["weight"].tolist() == pytest.approx(want, rel=1e-12, abs=0)
    assert moved["bias"].item() == pytest.approx(adam(BIAS, grad_b), rel=1e-12, abs=0)
    assert min(abs(g) for g in [*grad_w, grad_b]) > 1e-3  # each step is ~lr: a real move
    # S2: its state loads back bitwise, optimizer moments included
    _, again = tabular_program(lr=0.05)
    again.load_state_dict(program.state_dict())
    loaded = again.state_dict()["regressor"]
    assert torch.equal(loaded["weight"], moved["weight"])
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"],
                       moved["optimizer"]["state"][0]["exp_avg"])


def test_negative_control_a_regressor_that_never_steps_is_caught():
    """The step check above fails for a program whose close forgets the regressor."""
    model, program = tabular_program(lr=0.05)
    preset(program)
    program.prepare(model, prompts([list(range(P))]), clock=0, window=0,
                    device=torch.device("cpu"))
    program.regressor.step = lambda committed: None  # the planted bug
    program.close(closed(Outcome.COMMITTED))
    assert program.state_dict()["regressor"]["weight"].tolist() == list(WEIGHT)


@pytest.fixture
def chats():
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in
                                     {**TINY_POLICY, "policy.reward": "token_f1",
                                      "policy.baseline": "learned"}.items()]))
    parts = open_family(cfg)
    return cfg, parts, parts.family.build_model(cfg, parts.tokenizer.vocab_size)


def test_the_baselines_do_not_depend_on_the_microbatch_split(chats):
    cfg, parts, model = chats
    seen = {}
    for name, ids in {"1x8": [list(range(8))], "8x1": [[i] for i in range(8)]}.items():
        program = parts.family.program(cfg, parts, model, torch.device("cpu"))
        preset(program, weight=[0.01 * ((-1) ** j) for j in range(cfg.model.d_model)],
               bias=0.1)
        one_window(cfg, parts, model, ids, program=program)
        seen[name] = sorted((r["example"], r["sample"], r["baseline"]) for r in program.records)
    assert seen["1x8"] == seen["8x1"]
    assert len({b for _, _, b in seen["1x8"]}) > 1


@pytest.mark.slow
def test_a_run_learns_its_baseline(tmp_path, rewards):  # noqa: F811
    import json

    from run_support import set_args

    from exactstep.cli import main

    run = tmp_path / "run"
    assert main(["train", "--no-progress", "--out", str(run), *set_args(
        {**TINY_POLICY, "policy.reward": f"{rewards}:length", "policy.baseline": "learned",
         "policy.regressor_lr": 0.05, "train.steps": 24, "update.lr": 1e-4})]) == 0
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    assert manifest["objective"]["policy"]["regressor"]["lr"] == 0.05
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    losses = [r["inputs"]["baseline_loss"] for r in ledger]
    assert all(x is not None for x in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.5 * first, losses  # it regresses the rewards it sees
