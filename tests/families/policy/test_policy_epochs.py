"""Several clipped optimizer steps per rollout batch (``policy.epochs``; Q1, Q4, U3, U4, S5).

- Reference: a tabular policy (logits ``E[x] + Pos[t]``, real rollouts, leave-one-out
  advantages, plain SGD) trained for ``E`` steps on one rollout batch matches the
  pure-Python float64 ``reference.tabular_clipped_sgd`` within a bound derived from
  fp32's rounding; the step size is large enough that the clip engages (the ledger's
  clipped-token counts equal the reference's, and every ratio is far enough from a
  clip edge that rounding cannot flip a decision). Negative controls: an unclipped
  ratio, and a ratio taken from the step's own start instead of the rollout's
  ``log pi_old``, are outside the bound; so is the reference with the other upper clip
  (symmetric 0.2 against DAPO's asymmetric 0.28: in this batch they clip differently).
- First step: on the built-in decoder, the first step of ``epochs = 2`` is the
  ``epochs = 1`` (REINFORCE) window's step bit for bit (its gradient and its weights).
  Negative control: a first step that takes ``rho = exp(log pi - log pi_old)`` with the
  trainer's fp32 log-softmax against the sampler's recorded float64 value is not (a
  ratio of 1 up to rounding). The float64 recomputation that the later steps use is
  within 2e-8 of the sampler's here, below fp32's rounding of the coefficients: a
  first step on it would pass; the first step takes 1 itself, so that no gap (bf16
  autocast, dropout, another kernel) can reach it.
- Transaction: a NaN in the second step leaves the model, the optimizer (Adam's
  moments), the schedule, the scaler, the counters and the baseline bitwise as before
  the window; the window is one ``SKIPPED_NONFINITE`` line. Negative control: an engine
  that keeps the first step's update is caught.
- Bad inputs: each one ``error:`` line before anything is written.
- S5 (slow): a run with ``epochs = 3`` SIGKILLed between two steps of a window, twice,
  and resumed is bitwise the straight run.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import signal

import numpy as np
import pytest
import torch
from families.policy.test_policy_gradient import TabularPolicy, one_token_prompts, reward
from families.policy.test_policy_kill_resume import POLICY, REWARD
from families.policy.test_policy_run import (  # noqa: F401 (rewards: a fixture)
    TINY_POLICY,
    one_error_line,
    rewards,
    train,
    window_of,
)
from families.test_family_kill_resume import FamilyHarness, final_state

import exactstep.families.policy.clipped as clipped_module
from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.families import open_family, resolve
from exactstep.families.policy import reference
from exactstep.families.policy.clipped import ClippedRollouts, sampled_logprobs
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.rewards import Reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.policy import policy_plan
from exactstep.rows.batch import Batch
from exactstep.rows.example import Example
from exactstep.state.compare import state_differences
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

K, P = 4, 8
U = 2.0 ** -24  # fp32's unit roundoff


class Recording(ClippedRollouts):
    """Keeps the window's trajectory batches (the tokens the reference trains on)."""

    def prepare(self, *args, **kwargs):
        batches, info = super().prepare(*args, **kwargs)
        self.prepared = batches
        return batches, info


class FromStepStart(Recording):
    """WRONG: ``rho`` against each step's own starting log-probabilities (always 1:
    plain REINFORCE repeated), not the rollout's ``log pi_old``."""

    def next_pass(self, model, batches, *, step, device, reducer=None):
        fresh = []
        for b in batches:
            rows = b.meta["policy"]
            live = sampled_logprobs(model, b, rows.sampled, device)
            fresh.append(Batch(**{**b.__dict__, "meta": {**b.meta, "policy": type(rows)(
                rows.coefficient, rows.trajectory, rows.sampled, live)}}))
        return super().next_pass(model, fresh, step=step, device=device, reducer=reducer)


def unclipped(coefficient, logprob, old_logprob, sampled, *, low, high):
    """WRONG: the importance ratio without its clip."""
    rho = torch.where(sampled, torch.exp(logprob - old_logprob), 1.0)
    return torch.where(sampled, coefficient * rho, coefficient), rho, sampled & False


def tabular_engine(epochs: int, *, lr: float, high: float = 0.0, program=Recording,
                   optimizer: str = "sgd"):
    model = TabularPolicy()
    examples = [Example(example_id=i, tokens=np.array([0, 1, 2], dtype=np.int64))
                for i in range(P)]
    scored = Reward("tabular", lambda s: reward(tuple(s.response)),
                    {"name": "tabular", "kind": "test"}, False)
    policy = PolicyConfig(over="causal", baseline="leave_one_out", epochs=epochs,
                          clip_ratio=0.2, clip_ratio_high=high)
    rollouts = program(policy, GenerationConfig(samples=K, max_new_tokens=2), seed=3,
                       seq_len=8, examples=examples, reward=scored, stop_ids=(),
                       decode=lambda ids: " ".join(map(str, ids)))
    cfg = UpdateConfig(lr=lr, schedule="constant", warmup=0, clip=0.0, weight_decay=0.0,
                       optimizer=optimizer, momentum=0.0)
    opt, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(model, opt, build_schedule(cfg, 10 * epochs),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=0), device="cpu", pad_id=0,
                          plan=policy_plan("token_mean", 1.0), program=rollouts)
    return model, rollouts, engine



def reference_trajectories(batches: list[Batch]) -> list[reference.Trajectory]:
    """The sampled tokens of the window, with advantages recomputed from the rewards
    (leave-one-out over each prompt's ``K`` samples), independently of the engine."""
    rows = []
    for b in batches:
        for i in range(b.input_ids.shape[0]):
            cols = b.meta["policy"].sampled[i].nonzero().squeeze(1).tolist()
            drawn = tuple(int(b.labels[i, c]) for c in cols)
            rows.append((b.segments[i][0].example_id, int(b.input_ids[i, 0]), drawn))
    out = []
    for start in range(0, len(rows), K):
        group = rows[start:start + K]
        assert len({g[0] for g in group}) == 1  # one prompt's samples, in order
        adv = reference.advantages([reward(g[2]) for g in group], "leave_one_out")
        out += [reference.Trajectory((g[1], *g[2]), 1, (a,) * len(g[2]))
                for g, a in zip(group, adv, strict=True)]
    return out


def fp32_bound(embed0, pos0, masses, lr: float, n_terms: int, zmax: float) -> float:
    """Twice a bound on the fp32 engine's distance from the float64 reference after the
    steps whose gradient masses (``sum_r |c_r| / D``) are ``masses``: each step's
    gradient entries carry at most ``(n + 8) u`` of that mass in rounding (``n`` terms
    summed, the softmax's exp / sum / divide), the ratio ``2 u |z|max`` of it, the
    update its own ``u |theta|``; an earlier error moves a later gradient by at most
    ``2 mass`` times itself (the softmax's Jacobian is below 1, two tables per logit)."""
    err, theta = 0.0, max(abs(v) for row in embed0 + pos0 for v in row)
    for mass in masses:
        theta += lr * 2 * mass
        err = err * (1 + 2 * lr * mass) + lr * mass * ((n_terms + 8) * U + 2 * U * zmax) \
            + U * theta
    return 2 * err


def run_reference_case(epochs: int, lr: float, high: float, program=Recording):
    model, rollouts, engine = tabular_engine(epochs, lr=lr, high=high, program=program)
    embed0, pos0 = model.embed.detach().double().tolist(), model.pos.detach().double().tolist()
    d = engine.run_window([one_token_prompts(P)], 0)
    trajectories = reference_trajectories(rollouts.prepared)
    want = reference.tabular_clipped_sgd(
        embed0, pos0, trajectories, epochs=epochs, lr=lr,
        d=float(sum(len(t.advantages) for t in trajectories)), low=0.2, high=high or 0.2)
    return model, d, want, embed0, pos0, trajectories


def distance(model, want) -> float:
    got = model.embed.detach().double().tolist() + model.pos.detach().double().tolist()
    ref = want.embed + want.pos
    return max(abs(a - b) for ra, rb in zip(got, ref, strict=True)
               for a, b in zip(ra, rb, strict=True))


@pytest.mark.parametrize("high", [0.0, 0.28], ids=["symmetric", "asymmetric"])
def test_e_clipped_steps_match_the_float64_reference_and_the_clip_engages(high):
    epochs, lr = 3, 2.0
    model, d, want, embed0, pos0, trajectories = run_reference_case(epochs, lr, high)
    assert d.outcome is Outcome.COMMITTED
    record = d.ledger_record()
    assert [s["disposition"] for s in record["steps"]] == ["COMMITTED"] * epochs
    clipped = [s["inputs"]["clipped_tokens"] for s in record["steps"][1:]]
    assert clipped == want.clipped[1:] and sum(clipped) > 0  # the clip engaged
    assert want.clipped[0] == 0
    assert want.margin > 1e-4  # no decision within rounding of a clip edge
    zmax = max(abs(v) for row in want.embed + want.pos for v in row) * 2
    tol = fp32_bound(embed0, pos0, want.masses, lr, len(trajectories) * 2, zmax)
    assert distance(model, want) <= tol, (distance(model, want), tol)
    # negative controls: each wrong variant is outside the same bound
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(clipped_module, "clipped_coefficients", unclipped)
        wrong, *_ = run_reference_case(epochs, lr, high)
    assert distance(wrong, want) > 100 * tol
    wrong, *_ = run_reference_case(epochs, lr, high, program=FromStepStart)
    assert distance(wrong, want) > 100 * tol
    # and the other upper clip is another update: clip_ratio_high is honoured
    other = reference.tabular_clipped_sgd(
        embed0, pos0, trajectories, epochs=epochs, lr=lr,
        d=float(sum(len(t.advantages) for t in trajectories)), low=0.2,
        high=0.2 if high else 0.28)
    assert distance(model, other) > 100 * tol


def tiny(extra: dict):
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in {
        **TINY_POLICY, "policy.reward": "policy_rewards:length", "update.lr": 0.05,
        **extra}.items()]))
    parts = open_family(cfg)
    return cfg, parts


def decoder_engine(cfg, parts, program=None, optimizer=None):
    torch.manual_seed(0)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = program or parts.family.program(cfg, parts, model, torch.device("cpu"))
    opt, _ = build_optimizer(model, cfg.update)
    grads: list = []
    opt.register_step_pre_hook(lambda o, *_: grads.append(
        [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]))
    after: list = []
    opt.register_step_post_hook(lambda o, *_: after.append(
        [p.detach().clone() for p in model.parameters()]))
    engine = UpdateEngine(model, opt, build_schedule(cfg.update, 10),
                          Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                          device="cpu", pad_id=parts.tokenizer.pad_id,
                          plan=parts.family.plan(cfg, 0), program=program)
    return model, program, engine, grads, after


class FirstStepRatio(ClippedRollouts):
    """WRONG: the first step weighted by ``rho = exp(log pi - log pi_old)``, ``log pi``
    the trainer's own fp32 log-softmax, against the sampler's recorded float64 value: a
    ratio 1 only up to the two computations' rounding."""

    def prepare(self, model, batches, *, device, **kwargs):
        out, info = super().prepare(model, batches, device=device, **kwargs)
        weighted = []
        for b in out:
            rows = b.meta["policy"]
            with torch.no_grad():
                logits = model.logits(model(b))  # [B, T, V] fp32
                logp = torch.log_softmax(logits, -1).gather(
                    -1, b.labels.clamp(min=0)[..., None])[..., 0].double()
            rho = torch.where(rows.sampled, torch.exp(logp - rows.old_logprob), 1.0)
            weighted.append(Batch(**{**b.__dict__, "meta": {**b.meta, "policy": type(rows)(
                rows.coefficient * rho, rows.trajectory, rows.sampled, rows.old_logprob)}}))
        return weighted, info


@pytest.mark.usefixtures("rewards")
def test_the_first_step_is_the_reinforce_window_step_bit_for_bit():
    window = [[0, 1, 2, 3], [4, 5, 6, 7]]
    cfg1, parts1 = tiny({"policy.epochs": 1})
    _, _, e1, grads1, after1 = decoder_engine(cfg1, parts1)
    d1 = e1.run_window(window_of(parts1, window), 0)
    cfg2, parts2 = tiny({"policy.epochs": 2})
    _, program, e2, grads2, after2 = decoder_engine(cfg2, parts2)
    d2 = e2.run_window(window_of(parts2, window), 0)
    assert isinstance(program, ClippedRollouts)
    assert d1.outcome is d2.outcome is Outcome.COMMITTED
    assert len(grads1) == 1 and len(grads2) == 2
    assert state_differences(grads1[0], grads2[0]) == []
    assert state_differences(after1[0], after2[0]) == []
    assert state_differences(after1[0], after2[1]) != []  # the second step moved
    r1, r2 = d1.ledger_record(), d2.ledger_record()
    assert {k: v for k, v in r2.items() if k != "steps"} == r1  # the on-policy figures
    samples = program.records
    assert all(len(s["old_logprobs"]) == s["tokens"] for s in samples)
    # negative control: the ratio against the sampler's value on the first step
    cfg3, parts3 = tiny({"policy.epochs": 2})
    _, _, e3, grads3, _ = decoder_engine(cfg3, parts3, program=FirstStepRatio(
        cfg3.policy, cfg3.generation, seed=cfg3.seed, seq_len=cfg3.batch.seq_len,
        examples=parts3.data.train, reward=program.reward, stop_ids=program.stop_ids,
        decode=program.decode))
    e3.run_window(window_of(parts3, window), 0)
    assert state_differences(grads1[0], grads3[0]) != []


class NanSecond(ClippedRollouts):
    """A NaN in one coefficient of window 1's second step."""

    def prepare(self, model, batches, *, window, **kwargs):
        self.window = window
        return super().prepare(model, batches, window=window, **kwargs)

    def next_pass(self, model, batches, *, step, device, reducer=None):
        out = super().next_pass(model, batches, step=step, device=device, reducer=reducer)
        if out is None or step != 1 or self.window != 1:
            return out
        rows = out[0][0].meta["policy"]
        coefficient = rows.coefficient.clone()
        coefficient[rows.sampled] = torch.where(
            torch.arange(int(rows.sampled.sum())) == 0, math.nan, coefficient[rows.sampled])
        b = out[0][0]
        out[0][0] = Batch(**{**b.__dict__, "meta": {**b.meta, "policy": type(rows)(
            coefficient, rows.trajectory, rows.sampled, rows.old_logprob)}})
        return out


class KeepsFirstStep(UpdateEngine):
    """WRONG: a skipped window of several steps that keeps its first step's update."""

    def _restore(self, saved):
        counters = saved[1]["counters"]
        for name, value in counters.items():
            setattr(self, name, value)


@pytest.mark.usefixtures("rewards")
def test_a_nan_in_the_second_step_undoes_the_whole_window_bit_for_bit():
    cfg, parts = tiny({"policy.epochs": 3, "policy.baseline": "moving_average",
                       "update.optimizer": "adamw"})
    for engine_cls, caught in ((UpdateEngine, False), (KeepsFirstStep, True)):
        torch.manual_seed(0)
        model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
        program = NanSecond(cfg.policy, cfg.generation, seed=cfg.seed,
                            seq_len=cfg.batch.seq_len, examples=parts.data.train,
                            reward=parts.family.program(cfg, parts, model, "cpu").reward,
                            stop_ids=(parts.tokenizer.eos_id,),
                            decode=parts.tokenizer.decode)
        opt, _ = build_optimizer(model, cfg.update)
        engine = engine_cls(model, opt, build_schedule(cfg.update, 30),
                            Precision(cfg.numerics, "cpu"), cfg.update, cfg.objective,
                            device="cpu", pad_id=parts.tokenizer.pad_id,
                            plan=parts.family.plan(cfg, 0), program=program)
        first = engine.run_window(window_of(parts, [[0, 1, 2, 3]]), 0)  # commits: state
        assert first.outcome is Outcome.COMMITTED and len(first.steps) == 3
        before = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "engine": engine.state_dict(), "lr": engine.schedule.lr()}
        before = {**before, "engine": copy.deepcopy(before["engine"])}
        d = engine.run_window(window_of(parts, [[4, 5, 6, 7]]), 1)
        assert d.outcome is Outcome.SKIPPED_NONFINITE and d.lr is None
        assert [s["disposition"] for s in d.ledger_record()["steps"]] == [
            "COMMITTED", "SKIPPED_NONFINITE"]
        after = {"model": dict(model.state_dict()), "engine": engine.state_dict(),
                 "lr": engine.schedule.lr()}
        expected = {**before["engine"], "counters": {**before["engine"]["counters"],
                                                    "skipped": 1, "microbatches": 2}}
        differences = state_differences({**before, "engine": expected}, after)
        assert (differences != []) is caught, differences
        if not caught:
            assert program.moving_average is not None  # the first window's, unchanged
            assert after["engine"]["program"] == before["engine"]["program"]


@pytest.mark.parametrize("extra, words", [
    ({"policy.epochs": 0}, ["policy.epochs", "[1, 1024]"]),
    ({"policy.clip_ratio": 0}, ["policy.clip_ratio", "(0, 1]"]),
    ({"policy.clip_ratio_high": -0.1}, ["policy.clip_ratio_high", ">= 0"]),
    ({"policy.epochs": 2, "policy.mixer": "true"}, ["policy.mixer = false"]),
    ({"policy.epochs": 2, "policy.kl": "k3", "policy.beta": 0.1,
      "policy.reference": "x"}, ["k1", "policy.epochs = 1"]),
    ({"policy.epochs": 2, "policy.kl": "k3_corrected", "policy.beta": 0.1,
      "policy.reference": "x"}, ["'k3_corrected'", "policy.epochs = 1"]),
])
def test_each_bad_epochs_setting_is_one_error_line_before_anything_is_written(
        tmp_path, capsys, extra, words):
    run = tmp_path / "run"
    assert train(run, **{"train.steps": 2, **extra}) != 0
    line = one_error_line(capsys)
    assert all(w in line for w in words), line
    assert not (run / "ledger.jsonl").exists() or not (run / "ledger.jsonl").read_text()


def test_policy_config_refuses_a_bad_epoch_count_directly():
    with pytest.raises(ConfigError, match="policy.epochs"):
        PolicyConfig(epochs=0)
    assert PolicyConfig(clip_ratio=0.2).clip_high == 0.2
    assert PolicyConfig(clip_ratio=0.2, clip_ratio_high=0.28).clip_high == 0.28
    assert "epochs" not in PolicyConfig().describe()
    assert PolicyConfig(epochs=2).describe()["epochs"]["clock"] == \
        "committed_optimizer_steps"


@pytest.mark.usefixtures("rewards")
def test_epochs_one_is_the_plain_program():
    cfg, parts = tiny({"policy.epochs": 1})
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    program = parts.family.program(cfg, parts, model, torch.device("cpu"))
    assert type(program) is PolicyRollouts and not hasattr(program, "next_pass")
    ledger = json.dumps(PolicyConfig().describe())
    assert "clip" not in ledger


#: Launcher prelude: ``next_pass:N`` SIGKILLs the process right after the N-th
#: ``next_pass`` returns, between two steps of a window (the earlier one applied in memory).
BETWEEN_STEPS = """
if kill_at.startswith("next_pass:"):
    import exactstep.families.policy.clipped as clipped
    _next_pass, _calls, _nth = clipped.ClippedRollouts.next_pass, [0], int(kill_at[10:])
    def _counted(self, *args, **kwargs):
        out = _next_pass(self, *args, **kwargs)
        _calls[0] += 1
        if _calls[0] == _nth and out is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    clipped.ClippedRollouts.next_pass = _counted
    kill_at = "none"
"""


class BetweenSteps(FamilyHarness):
    def __init__(self, root, family) -> None:
        super().__init__(root, family)
        text = self.launcher.read_text()
        marker = "\nif argv[0] == \"train\":"
        assert marker in text
        self.launcher.write_text(text.replace(marker, BETWEEN_STEPS + marker, 1))


@pytest.mark.slow
def test_a_run_killed_between_two_clipped_steps_resumes_bitwise(tmp_path):
    """S5 with ``policy.epochs = 3``: SIGKILLed twice between two steps of a window (the
    first step applied in memory, not checkpointed), resumed each time: the final
    checkpoint, the ledger, the manifest and the rollout journal (every ``log pi_old``)
    are byte-identical to the straight run's; the clock counts the committed steps.
    Negative control: the same resume without its data cursor ends elsewhere."""
    (tmp_path / "policy_rewards.py").write_text(REWARD)
    h = BetweenSteps(tmp_path, {**POLICY, "train.threads": 1, "policy.epochs": 3,
                                "policy.clip_ratio": 0.1, "update.optimizer": "adamw"})
    straight, killed, defective = tmp_path / "straight", tmp_path / "killed", tmp_path / "nc"
    assert h.train(straight) == 0, h.last_output
    assert h.train(killed, kill_at="next_pass:10") == -signal.SIGKILL, h.last_output
    shutil.copytree(killed, defective)
    assert h.resume(killed, kill_at="next_pass:5") == -signal.SIGKILL, h.last_output
    assert h.resume(killed) == 0, h.last_output
    assert h.resume(defective, defect="no_cursor") == 0, h.last_output
    name_a, state_a, files_a = final_state(straight)
    name_b, state_b, files_b = final_state(killed)
    assert name_a == name_b and state_differences(state_a, state_b) == []
    assert files_a == files_b
    for name in ("ledger.jsonl", "manifest.json", "rollouts.jsonl"):
        assert (straight / name).read_bytes() == (killed / name).read_bytes(), name
    manifest = json.loads((straight / "manifest.json").read_bytes())["manifest"]
    assert manifest["objective"]["policy"]["epochs"]["epochs"] == 3
    ledger = [json.loads(x) for x in (straight / "ledger.jsonl").read_text().splitlines()]
    committed = sum(s["disposition"] == "COMMITTED" for r in ledger
                    if r["disposition"] == "COMMITTED" for s in r["steps"])
    assert committed >= 10  # several steps a window
    assert state_a["counters"]["committed"] == committed  # the clock: committed steps
    samples = [json.loads(x) for x in (straight / "rollouts.jsonl").read_text().splitlines()]
    assert samples and all(len(s["old_logprobs"]) == s["tokens"] for s in samples)
    differences = state_differences(state_a, final_state(defective)[1])
    assert any(d.startswith("model.") for d in differences)


#: Two clipped steps of SGD large enough that the second step's ratios leave 1.
RANK_LR = 2.0


def rank_config():
    from families.policy.test_policy_ranks import config

    return config(**{"policy.epochs": 2, "policy.clip_ratio": 0.1})


def step_capture(cfg, model):
    """``(update, optimizer, grads)``: SGD at ``RANK_LR`` whose every step appends the
    gradient it takes (float64) to ``grads``."""
    update = cfg.update.__class__(**{**cfg.update.__dict__, "optimizer": "sgd",
                                     "lr": RANK_LR, "clip": 0.0, "weight_decay": 0.0,
                                     "momentum": 0.0, "warmup": 0})
    optimizer, _ = build_optimizer(model, update)
    grads: list = []
    optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
        {n: p.grad.double().clone() for n, p in model.named_parameters()}))
    return update, optimizer, grads


class ReplayClipped(ClippedRollouts):
    """The clipped program on given trajectory batches (the fp32 run's rollouts), so a
    float64 window differs from the fp32 one in rounding alone."""

    def prepare(self, model, batches, **kwargs):
        return self.replay, {}


def clipped_engine(cfg, parts, model, program, *, reducer=None, engine_cls=UpdateEngine,
                   rank=0):
    update, optimizer, grads = step_capture(cfg, model)
    engine = engine_cls(model, optimizer, build_schedule(update, 4),
                        Precision(cfg.numerics, "cpu"), update, cfg.objective,
                        device="cpu", pad_id=parts.tokenizer.pad_id, reducer=reducer,
                        plan=parts.family.plan(cfg, rank), program=program)
    return engine, grads


def rank_steps(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """One rank of a two-step window on its share of the prompts; saves both steps'
    gradients and the ledger's step records."""
    from families.policy.test_policy_ranks import IDS, LocalD, length_reward

    from exactstep.parallel.agreement import distribute_engine
    from exactstep.parallel.config import ParallelConfig
    from exactstep.parallel.process_group import init_distributed, launcher_env, shutdown
    from exactstep.parallel.reducer import build_reducer

    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(timeout_s=60.0), "cpu",
                           env=launcher_env(rank, world, port))
    try:
        cfg = rank_config()
        parts = open_family(cfg)
        model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
        program = parts.family.program(cfg, parts, model, torch.device("cpu"))
        length_reward(program)
        engine, grads = clipped_engine(cfg, parts, model, program, reducer=build_reducer(ctx),
                                       engine_cls=LocalD if job.get("local_d") else
                                       UpdateEngine, rank=rank)
        distribute_engine(engine, ctx, ParallelConfig())
        d = engine.run_window(window_of(parts, [IDS[rank]]), 0)
        torch.save({"grads": grads, "steps": d.steps}, f"{out}/rank{rank}.pt")
    finally:
        shutdown(ctx)


@pytest.mark.slow
def test_two_ranks_take_the_same_clipped_steps_as_one_process(tmp_path):
    """Q4, D1 at every step: two gloo ranks (four prompts each) take both clipped steps
    with the gradients of the same window in one process, within twice the fp32
    gradients' distance from the same window in float64 (each step's); the clipped
    counts are the window's. Negative control: each rank normalising by its own share
    is outside it."""
    from families.policy.test_policy_ranks import IDS, length_reward
    from families.policy.test_policy_run import outside, spread_tolerance
    from parallel.workers import spawn_ranks

    results, codes, _ = spawn_ranks(rank_steps, 2, tmp_path, {}, deadline_s=300)
    assert codes == [0, 0], results
    cfg = rank_config()
    parts = open_family(cfg)
    model = parts.family.build_model(cfg, parts.tokenizer.vocab_size)
    start = copy.deepcopy(model)
    program = Recording(cfg.policy, cfg.generation, seed=cfg.seed, seq_len=cfg.batch.seq_len,
                        examples=parts.data.train, reward=None,
                        stop_ids=(parts.tokenizer.eos_id,), decode=parts.tokenizer.decode)
    length_reward(program)
    engine, single = clipped_engine(cfg, parts, model, program)
    d = engine.run_window(window_of(parts, [IDS[0] + IDS[1]]), 0)
    assert [s["disposition"] for s in d.ledger_record()["steps"]] == ["COMMITTED"] * 2
    exact_model = start.double()
    replay = ReplayClipped(cfg.policy, cfg.generation, seed=cfg.seed,
                           seq_len=cfg.batch.seq_len, examples=parts.data.train,
                           reward=program.reward, stop_ids=program.stop_ids,
                           decode=program.decode)
    replay.replay = program.prepared
    engine64, exact = clipped_engine(cfg, parts, exact_model, replay)
    engine64.run_window(window_of(parts, [IDS[0] + IDS[1]]), 0)
    assert len(single) == len(exact) == 2
    tolerance = [spread_tolerance(single[e], exact[e]) for e in range(2)]
    for rank in (0, 1):
        assert len(results[rank]["grads"]) == 2
        for e in range(2):
            assert outside(results[rank]["grads"][e], single[e], tolerance[e]) == [], (rank, e)
        got, want = results[rank]["steps"][1]["inputs"], d.steps[1]["inputs"]
        assert (got["sampled_tokens"], got["clipped_tokens"]) == \
            (want["sampled_tokens"], want["clipped_tokens"])
        assert got["ratio_mean"] == pytest.approx(want["ratio_mean"], rel=1e-6)
    assert d.steps[1]["inputs"]["clipped_tokens"] > 0  # the clip engaged
    (tmp_path / "wrong").mkdir()
    wrong, codes, _ = spawn_ranks(rank_steps, 2, tmp_path / "wrong", {"local_d": True},
                                  deadline_s=300)
    assert codes == [0, 0], wrong
    assert outside(wrong[0]["grads"][1], single[1], tolerance[1]) != []


class AllClipped(ClippedRollouts):
    """The second step's every coefficient 0 (every token clipped)."""

    def next_pass(self, model, batches, *, step, device, reducer=None):
        out = super().next_pass(model, batches, step=step, device=device, reducer=reducer)
        if out is None:
            return out
        zeroed = []
        for b in out[0]:
            rows = b.meta["policy"]
            zeroed.append(Batch(**{**b.__dict__, "meta": {**b.meta, "policy": type(rows)(
                torch.zeros_like(rows.coefficient), rows.trajectory, rows.sampled,
                rows.old_logprob)}}))
        return zeroed, out[1]


class StepsOnZero(UpdateEngine):
    """WRONG (L4): a step with no gradient taken anyway (Adam's moments move it)."""

    def _run_planned(self, batches, window, program_info):
        rows = batches[0].meta["policy"]
        if not bool(rows.coefficient.any()):
            signal = Batch(**{**batches[0].__dict__, "meta": {**batches[0].meta, "policy":
                type(rows)(rows.coefficient + 1e-30 * rows.sampled, rows.trajectory,
                           rows.sampled, rows.old_logprob)}})
            batches = [signal, *batches[1:]]
        return super()._run_planned(batches, window, program_info)


@pytest.mark.usefixtures("rewards")
def test_a_step_whose_every_token_is_clipped_is_not_taken_and_ends_the_window():
    """L4 for a later step: no gradient, no step (Adam would move on momentum alone);
    the window commits with its first step, counted once. Negative control: an engine
    that takes the zero step moves the weights."""
    cfg, parts = tiny({"policy.epochs": 3, "update.optimizer": "adamw"})
    for engine_cls, moved in ((UpdateEngine, False), (StepsOnZero, True)):
        _, program, engine, _, after = decoder_engine(cfg, parts, program=AllClipped(
            cfg.policy, cfg.generation, seed=cfg.seed, seq_len=cfg.batch.seq_len,
            examples=parts.data.train,
            reward=parts.family.program(cfg, parts, None, "cpu").reward,
            stop_ids=(parts.tokenizer.eos_id,), decode=parts.tokenizer.decode))
        engine.__class__ = engine_cls
        d = engine.run_window(window_of(parts, [[0, 1, 2, 3]]), 0)
        assert d.outcome is Outcome.COMMITTED
        final = [p.detach() for p in engine.model.parameters()]
        if not moved:
            assert [s["disposition"] for s in d.ledger_record()["steps"]] == [
                "COMMITTED", "NO_OBJECTIVE"]
            assert engine.counters()["committed"] == 1
            assert engine.counters()["no_objective"] == 0
            assert len(after) == 1 and state_differences(after[0], final) == []
        else:
            assert state_differences(after[0], final) != []
