"""The expected updates the manifest declares for each KL option and normaliser, by
exact enumeration (Q3, Q4; ``PolicyConfig.describe``).

A tabular policy small enough to enumerate: a vocabulary of three (0 the stop token),
responses of at most two tokens, so seven sequences: ``(0,)`` and ``(a, b)`` for
``a`` in 1, 2 and any ``b``. Every sequence's probability is known, so the expectation
over ``y ~ pi`` of a window's update is a finite sum, computed in float64 and compared
with the gradient of the exact quantity the manifest names (autograd on the
enumerated KL or objective, not on the estimator).

KL (``PolicyRollouts.sampled_coefficients``, the engine's coefficients): ``k3`` in the
loss has expected gradient ``beta * grad KL(pi_ref || pi)`` per token (contexts held
fixed); ``k3_corrected`` has ``beta * grad KL(pi || pi_ref)`` per token; neither is
the sequence distribution's ``grad KL(pi || pi_ref)`` once responses have two tokens
(that one is k1's, in the reward), and ``k3_corrected`` is it for one-token
responses. Negative controls: each option against the other's KL is caught. The
window program end to end (``prepare``: draws, the frozen reference's forward, the
trajectory rows) puts each option's coefficient on its tokens, against
log-probabilities computed by hand; the other option's formula is caught.

Normalisers (``reference.window_coefficients``, the pure-Python statement the engine
is checked against in ``test_policy_objective``), one prompt, ``K = 2``,
leave-one-out, every pair of responses enumerated: ``constant`` is exactly
``K grad E[R] / constant``; ``sequence_mean`` is ``grad E[(R - b) / L]`` with ``b``
held at ``E[R]``; ``token_mean`` is the length-weighted
``2 grad sum_y pi(y) E_y'[(R(y) - R(y')) / (L(y) + L(y'))]``, and not the
``K grad E[R] / E[D]`` a ratio of expectations would give (the negative control).
The manifest's entries say each of these.
"""

from __future__ import annotations

import math

import pytest
import torch
from families.policy.test_policy_gradient import TabularPolicy
from families.policy.test_policy_gradient import reward as tab_reward

from exactstep.families.policy import reference
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.rewards import Reward, load_reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import Continuation
from exactstep.rows.batch import Batch, Segment
from exactstep.rows.example import Example

V, BETA = 3, 0.7
# float64 sums of a few dozen products of O(1) terms: each within ~1e-16 relative;
# 1e-12 leaves four orders of margin and sits ten orders below the gaps the
# negative controls measure (>= 1e-3).
TOL = 1e-12


def logits(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g, dtype=torch.float64),
            torch.randn(V, V, generator=g, dtype=torch.float64))


FIRST, SECOND = logits(3)  # the policy's parameters
REF_FIRST, REF_SECOND = logits(11)  # the frozen reference


def sequences(longest: int) -> list[tuple[int, ...]]:
    if longest == 1:
        return [(t,) for t in range(V)]
    return [(0,)] + [(a, b) for a in range(1, V) for b in range(V)]


def token_logps(first: torch.Tensor, second: torch.Tensor, y: tuple[int, ...]
                ) -> list[torch.Tensor]:
    """``log pi(y_t | y_<t)`` for each token of ``y``."""
    out = [torch.log_softmax(first, -1)[y[0]]]
    if len(y) > 1:
        out.append(torch.log_softmax(second[y[0]], -1)[y[1]])
    return out


def params() -> tuple[torch.Tensor, torch.Tensor]:
    return FIRST.clone().requires_grad_(True), SECOND.clone().requires_grad_(True)


def gradient(total: torch.Tensor, first: torch.Tensor, second: torch.Tensor
             ) -> torch.Tensor:
    """``d total / d (first, second)``, flattened (zeros where a parameter is unused)."""
    grads = torch.autograd.grad(total, (first, second), allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                      for g, p in zip(grads, (first, second), strict=True)])


def program(kl: str) -> PolicyRollouts:
    return PolicyRollouts(PolicyConfig(kl=kl, beta=BETA, reference="ref"),
                          GenerationConfig(samples=2, max_new_tokens=2), seed=0, seq_len=8,
                          examples=[], reward=load_reward("exact_match", 4), stop_ids=(0,),
                          decode=str)


def expected_kl_update(kl: str, longest: int) -> torch.Tensor:
    """``E_{y ~ pi}[grad sum_t c_t (-log pi(y_t))]`` for the KL term's coefficients
    alone (advantage 0), enumerated."""
    first, second = params()
    prog = program(kl)
    total = torch.zeros((), dtype=torch.float64)
    for y in sequences(longest):
        lps = token_logps(first, second, y)
        refs = token_logps(REF_FIRST, REF_SECOND, y)
        prob = math.exp(sum(v.item() for v in lps))
        c = prog.sampled_coefficients(0.0, Continuation(y, tuple(v.item() for v in lps),
                                                        y[-1] == 0),
                                      [v.item() for v in refs])
        total = total + prob * sum(ct * -lp for ct, lp in zip(c, lps, strict=True))
    return gradient(total, first, second)


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) of two categorical distributions given by their logits."""
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum()


def per_token_kl_gradient(direction: str, longest: int) -> torch.Tensor:
    """``grad sum_t E_{h_t ~ pi}[KL_t]``, the contexts' probabilities held fixed;
    ``direction`` ``"forward"``: KL(pi || pi_ref), ``"reverse"``: KL(pi_ref || pi)."""
    first, second = params()

    def one(pol: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        return kl(pol, ref) if direction == "forward" else kl(ref, pol)

    total = one(first, REF_FIRST)
    if longest > 1:
        context = torch.softmax(FIRST, -1)  # not differentiated
        for a in range(1, V):
            total = total + context[a] * one(second[a], REF_SECOND[a])
    return gradient(total, first, second)


def sequence_kl_gradient(longest: int) -> torch.Tensor:
    """``grad KL(pi || pi_ref)`` of the sequence distribution, enumerated."""
    first, second = params()
    total = torch.zeros((), dtype=torch.float64)
    for y in sequences(longest):
        lp = sum(token_logps(first, second, y))
        lr = sum(token_logps(REF_FIRST, REF_SECOND, y))
        total = total + lp.exp() * (lp - lr)
    return gradient(total, first, second)


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_k3_in_the_loss_is_the_gradient_of_kl_ref_to_pi_per_token():
    got = expected_kl_update("k3", 2)
    assert distance(got, BETA * per_token_kl_gradient("reverse", 2)) < TOL
    # negative control: it is not the KL the reward-shaping penalty intends
    assert distance(got, BETA * per_token_kl_gradient("forward", 2)) > 1e-3
    assert distance(got, BETA * sequence_kl_gradient(2)) > 1e-3


def test_k3_corrected_is_the_gradient_of_kl_pi_to_ref_per_token():
    got = expected_kl_update("k3_corrected", 2)
    assert distance(got, BETA * per_token_kl_gradient("forward", 2)) < TOL
    # negative control: swapping the two options is caught
    assert distance(got, BETA * per_token_kl_gradient("reverse", 2)) > 1e-3


def test_k3_corrected_is_the_sequence_kl_for_one_token_responses_only():
    """As declared: one token, the per-token and sequence KL are one; with two, the
    sequence KL's gradient also weights the first token by the second's log-ratio."""
    assert distance(expected_kl_update("k3_corrected", 1), BETA * sequence_kl_gradient(1)) < TOL
    assert distance(expected_kl_update("k3_corrected", 2), BETA * sequence_kl_gradient(2)) > 1e-3


def test_k1_in_the_reward_is_the_sequence_kl_as_declared():
    """The manifest's k1 statement: a coefficient of ``-beta sum_s rho_s`` on every
    token of the sequence (the whole sequence's log-ratio) has expected loss gradient
    ``beta grad KL(pi || pi_ref)`` of the sequence distribution."""
    first, second = params()
    total = torch.zeros((), dtype=torch.float64)
    for y in sequences(2):
        lps, refs = token_logps(first, second, y), token_logps(REF_FIRST, REF_SECOND, y)
        shaped = -BETA * math.fsum(a.item() - b.item() for a, b in zip(lps, refs, strict=True))
        prob = math.exp(sum(v.item() for v in lps))
        total = total + prob * sum(shaped * -lp for lp in lps)
    got = gradient(total, first, second)
    assert distance(got, BETA * sequence_kl_gradient(2)) < TOL


def test_the_reference_states_k3_corrected_as_the_engine_computes_it():
    """``reference.k3_corrected_coefficient`` (from k3 + 1 - r) against the engine's
    (from the log-ratio), on every enumerated sequence; and the reference's window
    coefficients with ``kl = "k3_corrected"`` carry it."""
    prog = program("k3_corrected")
    for y in sequences(2):
        lps = [v.item() for v in token_logps(FIRST, SECOND, y)]
        refs = [v.item() for v in token_logps(REF_FIRST, REF_SECOND, y)]
        engine = prog.sampled_coefficients(0.0, Continuation(y, tuple(lps), True), refs)
        want = [reference.k3_corrected_coefficient(a, b, BETA)
                for a, b in zip(lps, refs, strict=True)]
        assert engine == pytest.approx(want, rel=1e-12, abs=1e-15)
        coeffs, _ = reference.window_coefficients(
            [[reference.Sample(0.0, 0, len(y), logprobs=tuple(lps), ref_logprobs=tuple(refs))]],
            baseline="none", normalizer="constant", kl="k3_corrected", beta=BETA)
        assert coeffs[0] == pytest.approx(want, rel=1e-12, abs=1e-15)


# -- the normalisers ------------------------------------------------------------------

def reward(y: tuple[int, ...]) -> float:
    return 1.0 if y == (1, 0) else (0.4 if y == (0,) else 0.1 * y[-1])


def expected_window_update(normalizer: str, constant: float = 3.0) -> torch.Tensor:
    """``E[-grad S / D]`` over every pair of responses to one prompt (``K = 2``,
    leave-one-out), each pair's coefficients and ``D`` from the reference."""
    first, second = params()
    seqs = sequences(2)
    logp = {y: token_logps(first, second, y) for y in seqs}
    prob = {y: math.exp(sum(v.item() for v in logp[y])) for y in seqs}
    total = torch.zeros((), dtype=torch.float64)
    for y1 in seqs:
        for y2 in seqs:
            coeffs, d = reference.window_coefficients(
                [[reference.Sample(reward(y1), 0, len(y1)),
                  reference.Sample(reward(y2), 0, len(y2))]],
                baseline="leave_one_out", normalizer=normalizer, constant=constant)
            s = sum(c * lp for cs, y in zip(coeffs, (y1, y2), strict=True)
                    for c, lp in zip(cs, logp[y], strict=True))
            total = total + prob[y1] * prob[y2] * s / d
    return gradient(total, first, second)


def expected_objective_gradient(objective) -> torch.Tensor:
    """``grad sum_y pi(y) f(y)``: ``f`` computed with the policy held fixed."""
    first, second = params()
    total = torch.zeros((), dtype=torch.float64)
    for y in sequences(2):
        total = total + sum(token_logps(first, second, y)).exp() * objective(y)
    return gradient(total, first, second)


PROB = {y: math.exp(sum(v.item() for v in token_logps(FIRST, SECOND, y)))
        for y in sequences(2)}
MEAN_R = math.fsum(PROB[y] * reward(y) for y in PROB)
MEAN_L = math.fsum(PROB[y] * len(y) for y in PROB)


def test_constant_is_unbiased():
    got = expected_window_update("constant", 3.0)
    assert distance(got, 2 * expected_objective_gradient(reward) / 3.0) < TOL


def test_sequence_mean_is_the_gradient_of_the_reward_per_token():
    got = expected_window_update("sequence_mean")
    per_token = expected_objective_gradient(lambda y: (reward(y) - MEAN_R) / len(y))
    assert distance(got, per_token) < TOL
    # negative control: it is not along the true gradient
    true = expected_objective_gradient(reward)
    assert float(got @ true / (got.norm() * true.norm())) < 1 - 1e-3


def test_token_mean_is_the_length_weighted_ratio_estimator():
    got = expected_window_update("token_mean")

    def weighted(y):
        return 2 * math.fsum(PROB[z] * (reward(y) - reward(z)) / (len(y) + len(z))
                             for z in PROB)

    assert distance(got, expected_objective_gradient(weighted)) < TOL
    # negative control: the ratio of expectations, K grad E[R] / E[D], is not it
    naive = 2 * expected_objective_gradient(reward) / (2 * MEAN_L)
    assert distance(got, naive) > 1e-3


# -- the manifest ---------------------------------------------------------------------

@pytest.mark.parametrize("normalizer,says", [
    ("token_mean", ("ratio estimator", "E[S / D] != E[S] / E[D]", "vanishes as 1 / N")),
    ("sequence_mean", ("1 / (L N)", "6x a 6-token", "does not vanish")),
    ("constant", ("unbiased", "N grad E[R] / constant")),
])
def test_the_manifest_declares_each_normalisers_bias(normalizer, says):
    entry = PolicyConfig(normalizer=normalizer).describe()["normalizer_bias"]
    assert all(s in entry for s in says), entry


@pytest.mark.parametrize("kl,says,denies", [
    ("k1", "beta * grad KL(pi || pi_ref) of the sequence distribution", None),
    ("k3", "E_{h_t ~ pi}[grad KL(pi_ref(.|h_t) || pi(.|h_t))]", "NOT grad KL(pi || pi_ref)"),
    ("k3_corrected", "E_{h_t ~ pi}[grad KL(pi(.|h_t) || pi_ref(.|h_t))]", None),
])
def test_the_manifest_declares_each_kl_options_expected_gradient(kl, says, denies):
    entry = PolicyConfig(kl=kl, beta=0.1).describe()["kl_estimator"]
    assert says in entry, entry
    if denies:
        assert denies in entry
    assert "kl_estimator" not in PolicyConfig().describe()


# -- the window program's coefficients ------------------------------------------------

def by_hand_logps(model, tokens: list[int]) -> list[float]:
    """``log pi`` of each drawn token of the tabular policy after prompt ``(0,)``: the
    logits ``embed[prev] + pos[t]`` added in fp32 as the model does, the log-softmax in
    float64."""
    seq = [0, *tokens]
    out = []
    for t, tok in enumerate(tokens):
        row = (model.embed[seq[t]] + model.pos[t]).detach().double()
        out.append(float(torch.log_softmax(row, -1)[tok]))
    return out


@pytest.mark.parametrize("kl", ["k3", "k3_corrected"])
def test_the_window_program_puts_each_options_coefficient_on_its_tokens(kl):
    """``PolicyRollouts.prepare`` end to end (addressed draws, the frozen reference's
    forward, the trajectory rows): each drawn token's coefficient is ``R - beta
    (1 - r_t)`` for ``k3`` and ``R - beta (log pi - log pi_ref)(y_t)`` for
    ``k3_corrected`` (``baseline = none``), from log-probabilities computed by hand;
    the other option's formula is the negative control."""
    model, ref = TabularPolicy(), TabularPolicy()
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        ref.embed.add_(0.8 * torch.randn(ref.embed.shape, generator=g))
        ref.pos.add_(0.8 * torch.randn(ref.pos.shape, generator=g))
    examples = [Example(example_id=i, tokens=torch.tensor([0, 1, 2]).numpy()) for i in range(4)]
    scored = Reward("tabular", lambda s: tab_reward(tuple(s.response)),
                    {"name": "tabular", "kind": "test"}, False)
    program = PolicyRollouts(PolicyConfig(over="causal", baseline="none", kl=kl, beta=BETA,
                                          reference="ref"),
                             GenerationConfig(samples=2, max_new_tokens=2), seed=3, seq_len=8,
                             examples=examples, reward=scored, stop_ids=(),
                             decode=lambda ids: " ".join(map(str, ids)), reference=ref)
    ids = list(range(4))
    window = [Batch(input_ids=torch.zeros((4, 1), dtype=torch.int64),
                    labels=torch.full((4, 1), -100, dtype=torch.int64),
                    position_ids=torch.zeros((4, 1), dtype=torch.int64),
                    segment_ids=torch.ones((4, 1), dtype=torch.int32),
                    segments=tuple((Segment(i, 0, 0, 0, 1),) for i in ids))]
    batches, _ = program.prepare(model, window, clock=0, window=0, device=torch.device("cpu"))
    rows, labels = batches[0].meta["policy"], batches[0].labels

    def formula(option: str, r: float, lp: float, lr: float) -> float:
        return r - BETA * ((1.0 - math.exp(lr - lp)) if option == "k3" else (lp - lr))

    other = "k3_corrected" if kl == "k3" else "k3"
    worst_other = 0.0
    for b in range(labels.shape[0]):
        tokens = labels[b][labels[b] != -100].tolist()
        lps, lrs = by_hand_logps(model, tokens), by_hand_logps(ref, tokens)
        r = tab_reward(tuple(tokens))
        got = rows.coefficient[b][labels[b] != -100].tolist()
        # float64 log-softmax of three fp32 logits, then one exp or difference: a few
        # ulps of values below 8
        assert got == pytest.approx([formula(kl, r, a, c) for a, c in zip(lps, lrs, strict=True)],
                                    rel=0, abs=1e-12)
        worst_other = max(worst_other, max(
            abs(g_ - formula(other, r, a, c)) for g_, a, c in zip(got, lps, lrs, strict=True)))
    assert worst_other > 1e-3
