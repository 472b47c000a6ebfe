"""The policy family through its real entry points (R8, Q1-Q4, U4, S1, X4).

- A run (``exactstep train``, the arithmetic chats, tiny shapes) records the estimator,
  the reward's identity and the sampling policy in its manifest, one ``rollouts.jsonl``
  line per sample, and the window's rollout figures in the ledger.
- Q1, Q4: the same window of eight prompts split as 1 x 8, 2 x 4 and 8 x 1 micro-batches
  samples the same tokens and gives the same gradient, within twice the fp32
  gradient's own distance from the same window in float64 (the spread of two fp32
  computations that differ only in summation order). Negative control: a window of
  other prompts is outside that tolerance.
- U4: the moving-average baseline moves only on a committed window (a skipped window,
  made non-finite by ``update.fail_window``, leaves it).
- X4: each bad input is one ``error:`` line, exit non-zero, nothing committed lost.
"""

from __future__ import annotations

import copy
import json
import textwrap
from pathlib import Path

import pytest
import torch
from run_support import set_args

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.rows.batch import Batch, Segment
from exactstep.state.store import latest_checkpoint, verify_checkpoint
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

TINY_POLICY = {"objective.family": "policy", "arith.n_train": 64, "arith.n_heldout": 8,
               "batch.seq_len": 128, "batch.rows": 2, "model.d_model": 16,
               "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
               "generation.max_new_tokens": 6, "generation.samples": 2,
               "train.eval_tokens": 64, "train.threads": 1, "train.device": "cpu",
               "arith.max_new_tokens": 6}
REWARDS = textwrap.dedent('''
    import math
    calls = [0]
    def length(prompt, completion, reference):
        return float(len(completion))
    def raises(prompt, completion, reference):
        calls[0] += 1
        if calls[0] > 12:
            raise ValueError("no score for this one")
        return float(len(completion))
    def nan(prompt, completion, reference):
        return math.nan
    def words(prompt, completion, reference):
        return [1.0]
''')


@pytest.fixture
def rewards(tmp_path, monkeypatch):
    (tmp_path / "policy_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "policy_rewards"


def train(out: Path, **extra) -> int:
    return main(["train", "--no-progress", "--out", str(out),
                 *set_args({**TINY_POLICY, **extra})])


def test_a_run_records_its_estimator_reward_and_every_sample(tmp_path, rewards):
    run = tmp_path / "run"
    assert train(run, **{"train.steps": 3, "policy.reward": f"{rewards}:length"}) == 0
    manifest = json.loads((run / "manifest.json").read_text())["manifest"]
    objective = manifest["objective"]
    assert objective["family"] == "policy_chat_sft"
    assert objective["policy"]["baseline"] == "leave_one_out"
    assert objective["policy"]["baseline_depends_on_sample"] is False
    assert objective["policy"]["normalizer_bias"].startswith("ratio estimator: ")
    assert objective["reward"]["name"] == f"{rewards}:length"
    assert len(objective["reward"]["source_sha256"]) == 64
    assert objective["generation"]["samples"] == 2
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(ledger) == 3
    assert sum(r["inputs"]["samples"] for r in ledger) == len(samples) > 0
    for r in ledger:
        if r["disposition"] == "COMMITTED":  # D: every scored token of the window
            assert r["D"] == r["inputs"]["sampled_tokens"] == r["tokens"]
    by_prompt: dict = {}
    for s in samples:
        by_prompt.setdefault((s["window"], s["example"]), []).append(s)
    for group in by_prompt.values():  # leave-one-out, recomputed from the journal
        assert len(group) == 2
        a, b = group
        assert a["advantage"] == a["reward"] - b["reward"]
        assert b["advantage"] == b["reward"] - a["reward"]


def window_of(parts, ids: list[list[int]]) -> list[Batch]:
    return [Batch(input_ids=torch.zeros((len(m), 1), dtype=torch.int64),
                  labels=torch.full((len(m), 1), -100, dtype=torch.int64),
                  position_ids=torch.zeros((len(m), 1), dtype=torch.int64),
                  segment_ids=torch.ones((len(m), 1), dtype=torch.int32),
                  segments=tuple((Segment(i, 0, 0, 0, 1),) for i in m)) for m in ids]


class Replay:
    """A window program that trains on given trajectory batches (the fp32 rollouts),
    so the float64 window differs from the fp32 one in rounding alone."""

    def __init__(self, batches):
        self.batches, self.records = batches, []

    def prepare(self, model, batches, **_):
        return self.batches, {}

    def close(self, disposition):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def gradient_capture(cfg, model):
    """``(update, optimizer, grads)``: SGD with a step of ~0 (the weights stay) whose
    every step appends the gradient it would take (float64) to ``grads``."""
    update = cfg.update.__class__(**{**cfg.update.__dict__, "optimizer": "sgd",
                                     "lr": 1e-30, "clip": 0.0, "weight_decay": 0.0,
                                     "momentum": 0.0})
    optimizer, _ = build_optimizer(model, update)
    grads = []
    optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
        {n: p.grad.double().clone() for n, p in model.named_parameters()}))
    return update, optimizer, grads


def spread_tolerance(single, exact):
    """Per tensor: twice the fp32 gradient's distance from the same window in float64
    (at least fp32's unit roundoff of the largest entry)."""
    return {n: 2 * max(float((single[n] - exact[n]).abs().max()),
                       2.0 ** -24 * float(exact[n].abs().max())) for n in exact}


def outside(grads, reference, tolerance) -> list[str]:
    """The tensors of ``grads`` farther from ``reference`` than ``tolerance``."""
    return [n for n in tolerance if float((grads[n] - reference[n]).abs().max()) > tolerance[n]]


def one_window(cfg, parts, model, ids, *, program=None, dtype=torch.float32):
    """The gradient the engine steps on for the window of prompts ``ids`` (SGD with a
    step of ~0, so the weights stay), and the trajectory batches it trained on."""
    model = copy.deepcopy(model).to(dtype)
    update, optimizer, grads = gradient_capture(cfg, model)
    program = program or parts.family.program(cfg, parts, model, torch.device("cpu"))
    seen = []
    prepare = program.prepare

    def recording(*a, **kw):
        out = prepare(*a, **kw)
        seen.append(out[0])
        return out

    program.prepare = recording
    engine = UpdateEngine(model, optimizer, build_schedule(update, 1),
                          Precision(cfg.numerics, "cpu"), update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    assert engine.run_window(window_of(parts, ids), 0).outcome is Outcome.COMMITTED
    return grads[0], seen[0]


def sampled_tokens(batches) -> list[list[int]]:
    rows = []
    for b in batches:
        for r in range(b.labels.shape[0]):
            rows.append(b.labels[r][b.labels[r] != -100].tolist())
    return rows


def test_a_window_split_three_ways_samples_and_steps_the_same(tmp_path, rewards):
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in
                                     {**TINY_POLICY, "policy.reward": f"{rewards}:length",
                                      "policy.baseline": "none"}.items()]))
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    splits = {"1x8": [list(range(8))], "2x4": [[0, 1, 2, 3], [4, 5, 6, 7]],
              "8x1": [[i] for i in range(8)]}
    results = {name: one_window(cfg, parts, model, ids) for name, ids in splits.items()}
    tokens = {name: sorted(sampled_tokens(b)) for name, (_, b) in results.items()}
    assert tokens["1x8"] == tokens["2x4"] == tokens["8x1"]  # Q1: the same samples
    exact, _ = one_window(cfg, parts, model, splits["1x8"],
                          program=Replay([b.map(lambda t: t) for b in results["1x8"][1]]),
                          dtype=torch.float64)
    reference = results["1x8"][0]
    tolerance = spread_tolerance(reference, exact)
    for name in ("2x4", "8x1"):
        assert outside(results[name][0], reference, tolerance) == [], name
    # negative control: another window's gradient is outside the same tolerance
    other, _ = one_window(cfg, parts, model, [list(range(8, 16))])
    assert outside(other, reference, tolerance) != []


def test_the_moving_average_moves_only_on_commit(tmp_path, rewards):
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in
                                     {**TINY_POLICY, "policy.reward": f"{rewards}:length",
                                      "policy.baseline": "moving_average",
                                      "update.fail_window": 0}.items()]))
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    optimizer, _ = build_optimizer(model, cfg.update)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg.update, 3),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    first = engine.run_window(window_of(parts, [[0, 1]]), 0)  # made non-finite: skipped
    assert first.outcome is Outcome.SKIPPED_NONFINITE
    assert program.moving_average is None  # the skipped window's rewards left it
    second = engine.run_window(window_of(parts, [[2, 3]]), 1)
    assert second.outcome is Outcome.COMMITTED
    rewards_1 = [r["reward"] for r in program.records]
    assert program.moving_average == sum(rewards_1) / len(rewards_1)
    assert engine.state_dict()["program"] == {"moving_average": program.moving_average}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    return errors[0]


@pytest.mark.parametrize("reward, words", [
    ("nan", ["returned nan", "finite"]),
    ("words", ["returned list", "one finite number"]),
])
def test_a_reward_that_is_not_one_finite_number_is_one_error_line(tmp_path, rewards, capsys,
                                                                 reward, words):
    assert train(tmp_path / "run", **{"train.steps": 2, "policy.reward":
                                      f"{rewards}:{reward}"}) != 0
    line = one_error_line(capsys)
    assert all(w in line for w in words) and "window 0, example" in line


def test_a_reward_that_raises_stops_the_run_with_its_committed_state_intact(tmp_path, rewards,
                                                                           capsys):
    run = tmp_path / "run"
    code = train(run, **{"train.steps": 6, "checkpoint.every": 1,
                         "policy.reward": f"{rewards}:raises"})
    assert code != 0
    line = one_error_line(capsys)
    assert "raised ValueError: no score for this one" in line and "nothing was committed" in line
    latest = latest_checkpoint(run / "checkpoints")
    assert latest is not None and verify_checkpoint(latest).ok
    windows = len((run / "ledger.jsonl").read_text().splitlines())
    assert latest.name == f"window-{windows:08d}" and 0 < windows < 6
    samples = (run / "rollouts.jsonl").read_text().splitlines()
    assert len(samples) == 12  # the scored samples of the committed windows, no more


@pytest.mark.parametrize("extra, words", [
    ({"generation.samples": 1}, ["leave_one_out", "generation.samples >= 2"]),
    ({"generation.temperature": 0.7}, ["generation.temperature = 1"]),
    ({"generation.max_new_tokens": 64, "batch.seq_len": 96}, ["longer than a row",
                                                             "batch.seq_len"]),
    ({"policy.kl": "k3", "policy.beta": 0.1}, ["policy.reference"]),
    ({"policy.reward": "no_such_module:f"}, ["cannot import"]),
])
def test_each_bad_setting_is_one_error_line_before_anything_is_written(tmp_path, capsys,
                                                                      extra, words):
    run = tmp_path / "run"
    assert train(run, **{"train.steps": 2, **extra}) != 0
    line = one_error_line(capsys)
    assert all(w in line for w in words), line
    assert not (run / "ledger.jsonl").exists() or not (run / "ledger.jsonl").read_text()
