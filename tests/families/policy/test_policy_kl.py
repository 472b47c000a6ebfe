"""Q3, Q4: the KL terms of a policy window against the pure-Python reference.

One window of the engine (real rollouts with addressed draws, the frozen reference's
log-probabilities, the policy plan, ``UpdateEngine``) on the tabular policy of
``test_policy_gradient`` in float64, with a frozen reference policy of other weights
(``token_mean``; k3 also under ``sequence_mean``, its term sharing the trajectory's 1),
``policy.kl`` = ``k1`` (``beta * sum_t (log pi - log pi_ref)`` subtracted from each
reward before the leave-one-out baseline) and ``k3`` (``beta * (r - log r - 1)``, ``r =
pi_ref / pi``, per sampled token: its coefficient ``beta (r - 1)`` on ``-log pi``) and
``k3_corrected`` (k3 times the ratio ``pi / sg(pi)``: ``-beta (log pi - log pi_ref)``).

Independent expectation: the sampled tokens are read from the window's rows; their
rewards, both policies' log-probabilities (a softmax written out with ``math``), the
coefficients and ``D`` (``families.policy.reference``) and the gradient of
``sum a * (-log pi) / D`` (``softmax - onehot`` per scored token) are computed here in
float64, with no engine function. Tolerance, derived: the engine rounds the logits to
fp32 before its log-softmax (each log-probability within ``eta = 2 * 2**-24 * max|z|``),
its coefficients to fp32 (``2**-24`` relative) and may form the token's softmax in fp32
(``4 * 2**-24`` per entry); the gradient entry's error is at most the sum over scored
tokens of the coefficient's error plus ``4 * 2**-24 |a|``, over ``D``; twice that.

Negative controls: the reference with the KL term's sign flipped (k1 added to the
reward, k3's coefficient negated) and the reference without the KL term are outside
the same tolerance, so the check tells a flipped or missing term apart.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from families.policy.test_policy_gradient import TARGET, TabularPolicy, V, one_token_prompts, reward

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

P, K, BETA = 6, 3, 0.5
STOP = 2  # a stop token: responses of one or two tokens, so D counts unequal lengths
UNIT = 2.0 ** -24


def scored_reward(y) -> float:
    y = tuple(y)
    return reward(y + (0,) * (2 - len(y))) + 0.5 * (len(y) == 1)



def engine_window(kl: str, normalizer: str = "token_mean", seed: int = 11):
    """The engine's float64 gradient of one window (a step of ~0: the weights stay),
    its rows, and the two models."""
    model, frozen = TabularPolicy(5).double(), TabularPolicy(9, scale=1.0).double().eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    examples = [Example(example_id=i, tokens=np.array([0, *TARGET], dtype=np.int64))
                for i in range(P)]
    scored = Reward("tabular", lambda s: scored_reward(s.response),
                    {"name": "tabular", "kind": "test"}, False)
    program = PolicyRollouts(PolicyConfig(over="causal", baseline="leave_one_out",
                                          normalizer=normalizer, kl=kl, beta=BETA,
                                          reference="frozen"),
                             GenerationConfig(samples=K, max_new_tokens=2), seed=seed,
                             seq_len=8, examples=examples, reward=scored, stop_ids=(STOP,),
                             decode=lambda ids: " ".join(map(str, ids)), reference=frozen)
    seen = []
    prepare = program.prepare
    program.prepare = lambda *a, **kw: seen.append(prepare(*a, **kw)) or seen[-1]
    cfg = UpdateConfig(lr=1e-30, schedule="constant", warmup=0, clip=0.0, weight_decay=0.0,
                       optimizer="sgd", momentum=0.0)
    optimizer, _ = build_optimizer(model, cfg)
    grads = []
    optimizer.register_step_pre_hook(lambda opt, *_: grads.append(
        {"embed": model.embed.grad.double().numpy().copy(),
         "pos": model.pos.grad.double().numpy().copy()}))
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, 1),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(chunk_rows=0), device="cpu", pad_id=0,
                          plan=policy_plan(normalizer, 1.0), program=program)
    assert engine.run_window([one_token_prompts(P)], 0).outcome is Outcome.COMMITTED
    (batches,), _ = seen[0]
    responses = [batches.labels[b][batches.labels[b] != IGNORE_INDEX].tolist()
                 for b in range(batches.labels.shape[0])]
    return grads[0], responses, model, frozen


def table(model: TabularPolicy) -> tuple[list[list[float]], list[list[float]]]:
    return model.embed.detach().double().tolist(), model.pos.detach().double().tolist()


def log_softmax(z: list[float]) -> list[float]:
    top = max(z)
    log_total = top + math.log(math.fsum(math.exp(x - top) for x in z))
    return [x - log_total for x in z]


def logits(params, context: list[int], t: int) -> list[float]:
    """The tabular logits of the token at column ``t`` (its input ``context[t]``)."""
    embed, pos = params
    return [embed[context[t]][v] + pos[t][v] for v in range(V)]


def logprobs(params, y: list[int]) -> list[float]:
    context = [0, *y]
    return [log_softmax(logits(params, context, t))[y[t]] for t in range(len(y))]


def expected(responses, model, frozen, kl: str, beta: float, normalizer: str = "token_mean"):
    """The reference's gradient of the window, float64, and its derived tolerance."""
    policy, ref = table(model), table(frozen)
    samples = [reference.Sample(scored_reward(y), 0, len(y), logprobs=tuple(logprobs(policy, y)),
                                ref_logprobs=tuple(logprobs(ref, y))) for y in responses]
    groups = [samples[i:i + K] for i in range(0, len(samples), K)]
    coeffs, d = reference.window_coefficients(groups, baseline="leave_one_out",
                                              normalizer=normalizer, kl=kl, beta=beta)
    grad = {"embed": np.zeros((V, V)), "pos": np.zeros((len(policy[1]), V))}
    zmax = max(abs(x) for params in (policy, ref) for rows in params for row in rows
               for x in row) * 2
    eta = 2 * UNIT * zmax  # one log-probability from fp32 logits
    # the shaped reward's error under k1 (both log-probabilities of each token), through
    # leave-one-out (own plus the others' mean): twice the largest
    k1_error = 2 * abs(beta) * max(2 * eta * s.sampled for s in samples) if kl == "k1" else 0.0
    bound = 0.0
    for y, cs, s in zip(responses, coeffs, samples, strict=True):
        context = [0, *y]
        for t, (token, a) in enumerate(zip(y, cs, strict=True)):
            p = [math.exp(x) for x in log_softmax(logits(policy, context, t))]
            for v in range(V):
                g = a * (p[v] - (v == token)) / d
                grad["embed"][context[t], v] += g
                grad["pos"][t, v] += g
            r = math.exp(s.ref_logprobs[t] - s.logprobs[t])
            k3_error = abs(beta) * r * 2 * eta * (1 + 2 * eta) if kl == "k3" else 0.0
            if kl == "k3_corrected":  # beta (log pi - log pi_ref): both within eta
                k3_error = abs(beta) * 2 * eta
            if normalizer == "sequence_mean":  # the coefficient's share of 1 / length
                k1_error, k3_error = k1_error / len(y), k3_error / len(y)
                a_error = 2 * UNIT * abs(a)  # the division's rounding and the fp32 cast
            else:
                a_error = UNIT * abs(a)  # the fp32 cast
            bound += a_error + k1_error + k3_error + 4 * UNIT * abs(a)
    return grad, 2 * bound / d


def outside(got, want, tolerance) -> list[str]:
    return [f"{n}: {np.abs(got[n] - want[n]).max():.3e} > {tolerance:.3e}" for n in want
            if np.abs(got[n] - want[n]).max() > tolerance]


@pytest.mark.parametrize("kl, normalizer", [("k1", "token_mean"), ("k3", "token_mean"),
                                            ("k3", "sequence_mean"),
                                            ("k3_corrected", "token_mean")])
def test_the_kl_window_gradient_is_the_references(kl, normalizer):
    grads, responses, model, frozen = engine_window(kl, normalizer)
    assert len(responses) == P * K and {len(y) for y in responses} == {1, 2}
    assert all(a != b for a, b in zip(logprobs(table(model), responses[0]),
                                      logprobs(table(frozen), responses[0]), strict=True))
    want, tolerance = expected(responses, model, frozen, kl, BETA, normalizer)
    assert tolerance < 1e-5
    assert outside(grads, want, tolerance) == []
    # negative controls: the term's sign flipped, or the term left out, is caught
    flipped, _ = expected(responses, model, frozen, kl, -BETA, normalizer)
    assert outside(grads, flipped, tolerance) != []
    plain, _ = expected(responses, model, frozen, "none", 0.0, normalizer)
    assert outside(grads, plain, tolerance) != []
    if kl.startswith("k3"):  # and k3 for k3_corrected (or back) is caught
        swapped, _ = expected(responses, model, frozen,
                              "k3" if kl == "k3_corrected" else "k3_corrected", BETA, normalizer)
        assert outside(grads, swapped, tolerance) != []


def test_the_reference_k3_coefficient_is_the_derivative_of_its_term():
    """The reference's own definitions agree: k3's coefficient on ``-log pi`` is minus
    the central difference of ``k3_term`` in ``log pi`` (float64, step 1e-5: error
    below 1e-8 here), and the term is 0 with a zero slope where the policies agree."""
    for lp, lr in [(-0.3, -1.2), (-2.0, -0.1), (-0.7, -0.7)]:
        h = 1e-5
        slope = (reference.k3_term(lp + h, lr, BETA) - reference.k3_term(lp - h, lr, BETA)) / (2 * h)
        assert abs(reference.k3_coefficient(lp, lr, BETA) + slope) < 1e-8
    assert reference.k3_term(-0.7, -0.7, BETA) == 0.0
    assert reference.k3_coefficient(-0.7, -0.7, BETA) == 0.0
    assert reference.k1_penalty([-0.3, -2.0], [-1.2, -0.1], BETA) == pytest.approx(
        BETA * ((-0.3 + 1.2) + (-2.0 + 0.1)), abs=1e-15)
