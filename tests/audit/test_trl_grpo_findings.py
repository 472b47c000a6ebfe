"""What AUDIT.md claims for ``trl``'s ``GRPOTrainer``, reproduced through the policy
probes (Q3, Q4).

Each finding is asserted as measured: the probe's status on the stock trainer (PASS
or FAIL) and, for a FAIL, the figure that names its reason, derived here from the
formula trl documents (not from the probe's own helpers); the same probe PASSes on
exactstep's own policy target (``audit.engine_policy``), so the probe can pass. A
trl release that changes a behaviour, or a probe that stops seeing it, fails the test
(``MEASURED`` says which trl). The stock trainer runs on a tiny random-init
``LlamaForCausalLM``; the probe's completions enter through trl's ``rollout_func``.
The split probe's findings sit in one table (``SPLIT``), so a change of that probe's
contract flips one entry.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")

from exactstep.audit.policy_probes import (  # noqa: E402
    POLICY_PROBES,
    SWAPPED_LENGTHS,
    K,
    baseline_window,
    split_window,
)
from exactstep.audit.probes import FAIL, PASS, run_probe  # noqa: E402
from exactstep.audit.trl_grpo import make  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
MEASURED = f"measured on trl {trl.__version__}; see AUDIT.md"
PROBES = {p.name: p for p in POLICY_PROBES}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def probe(variant: str, name: str):
    return run_probe(PROBES[name], make(variant))


def test_dapo_is_one_window_under_accumulation_and_ranks():
    """trl's default ``dapo`` divides by the generation batch's tokens gathered over the
    processes: the same coefficients as 1x8, 2x4, 4x2 and over two ranks."""
    assert probe("", "policy_split").status == PASS
    assert probe("", "policy_ranks").status == PASS


def test_trl_advantages_are_its_documented_formula():
    result = probe("", "policy_baseline")
    pairs = re.findall(r"m=(\d): ([+-][0-9.]+)/([+-][0-9.]+)", result.observed)

    def trl_advantage(own: float, m: int) -> float:
        rewards = [own] + [1.0] * m + [0.0] * (K - 1 - m)
        mean = sum(rewards) / K
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (K - 1))
        return (own - mean) / (std + 1e-4)

    assert len(pairs) == K
    for m, rewarded, unrewarded in pairs:
        assert float(rewarded) == pytest.approx(trl_advantage(1.0, int(m)), abs=2e-3)
        assert float(unrewarded) == pytest.approx(trl_advantage(0.0, int(m)), abs=2e-3)


RATES = (0.1, 0.25, 0.5, 0.75, 0.9)  # the success rates the baseline probe tables
FIGURE = 2e-3  # the probe prints kappa to 3 decimals (5e-4) of fp32-recovered advantages


def enumerated_kappa(advantage, p: float) -> float:
    """E[a_1 | r_1 = 1] - E[a_1 | r_1 = 0] over all 2^K binary reward patterns of a
    group whose other samples succeed with probability p (the expected update's scale
    on grad J; 1 for an unbiased estimator)."""
    given = {1: 0.0, 0: 0.0}
    for pattern in itertools.product((0, 1), repeat=K):
        prob = math.prod(p if r else 1 - p for r in pattern[1:])
        given[pattern[0]] += prob * advantage([float(r) for r in pattern])[0]
    return given[1] - given[0]


def trl_group_scaled(rewards):
    """trl's documented advantage with ``scale_rewards='group'``: (r - mean) / (std +
    1e-4), the unbiased standard deviation of the group."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def trl_unscaled(rewards):
    """``scale_rewards='none'``: r - the group's mean, the sample's own reward in it."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def kappas(observed: str) -> list[float]:
    return [float(k) for k in re.search(r"kappa\(p\) at p=[0-9./]+: ([0-9./]+);",
                                        observed).group(1).split("/")]


@pytest.fixture(scope="module")
def engine():
    from exactstep.audit.engine_policy import make as engine_policy

    return engine_policy()


def test_the_group_scaled_default_baseline_is_biased_by_p(engine):
    """FAIL (scale_rewards='group'): the division by the group's spread, which holds the
    sample's own reward, makes kappa depend on p: the enumerated kappa of trl's formula
    at each rate, far from 1. exactstep's leave-one-out PASSes the same probe."""
    result = probe("", "policy_baseline")
    assert result.status == FAIL, result.observed
    got = kappas(result.observed)
    want = [enumerated_kappa(trl_group_scaled, p) for p in RATES]
    assert got == pytest.approx(want, abs=FIGURE), MEASURED
    assert max(want) - min(want) > 0.05 and min(abs(k - 1.0) for k in want) > 0.3
    assert run_probe(PROBES["policy_baseline"], engine).status == PASS


def test_the_unscaled_baseline_is_k_minus_1_over_k(engine):
    """FAIL (scale_rewards='none'): the group mean includes the sample, so every
    advantage is r - mean, and kappa is (K - 1) / K at every p."""
    result = probe("dapo:none", "policy_baseline")
    assert result.status == FAIL, result.observed
    assert kappas(result.observed) == pytest.approx([(K - 1) / K] * len(RATES),
                                                    abs=FIGURE), MEASURED
    assert [enumerated_kappa(trl_unscaled, p) for p in RATES] == pytest.approx(
        [(K - 1) / K] * len(RATES), abs=1e-12)  # the formula's own figure
    window = baseline_window()
    want = [a for group in window.rewards for a in trl_unscaled(group)]
    assert result.observed_values == pytest.approx(want, abs=FIGURE), MEASURED
    assert run_probe(PROBES["policy_baseline"], engine).status == PASS


#: The split probe's status per trl ``loss_type`` (scale_rewards 'group'), as measured.
#: The probe checks Q4's contract itself, c x D = the sequence's advantage on the window
#: and on its length-swapped twin: ``grpo`` and ``sapo`` (each sequence's token mean)
#: keep 1x8 = 2x4 = 4x2 but FAIL it; ``bnpo`` FAILs its splits.
SPLIT = {"dapo": PASS, "bnpo": FAIL, "grpo": FAIL, "sapo": FAIL, "dr_grpo": PASS,
         "cispo": PASS, "vespo": PASS, "luspo": PASS}


def token_weight(loss_type: str, length: int, sequences: int, tokens: int,
                 longest: int) -> float:
    """The weight trl's documented loss puts on one token of a ``length``-token
    completion in one window (one micro-batch, on-policy: the ratio is 1): ``dapo``,
    ``bnpo`` (a single micro-batch), ``vespo`` (phi(1) = 1) and ``cispo`` (its clamp at
    ``epsilon_high`` = 0.2) over the window's tokens; ``dr_grpo`` over
    ``max_completion_length`` times the sequences; ``luspo`` each sequence's summed
    tokens over the sequences; ``grpo`` and ``sapo`` (its gate's slope at 1 is 1) each
    sequence's token mean over the sequences."""
    if loss_type in ("grpo", "sapo"):
        return 1.0 / (length * sequences)
    if loss_type == "dr_grpo":
        return 1.0 / (sequences * longest)
    if loss_type == "luspo":
        return 1.0 / sequences
    return (0.2 if loss_type == "cispo" else 1.0) / tokens


def per_microbatch_tokens(result, window) -> list[str]:
    """Where the split coefficients are NOT the whole window's divided by each
    micro-batch's own token count: under that normaliser the coefficient of completion i
    in a micro-batch of t tokens is the whole window's times N / (steps * t), so the
    completions sharing one ratio fill whole micro-batches of N / (steps * ratio)
    tokens each (whichever completions trl's sampler put together)."""
    lengths = [len(c) for group in window.completions for c in group]
    n, total, bad = len(lengths), sum(lengths), []
    for run, size in enumerate((4, 2)):
        got = result.observed_values[run * n:(run + 1) * n]
        whole = result.expected_values[run * n:(run + 1) * n]
        steps = n // size
        classes: dict[float, list[int]] = {}
        for i, (g, w) in enumerate(zip(got, whole, strict=True)):
            classes.setdefault(round(g / w, 3), []).append(i)
        for ratio, members in classes.items():
            tokens = sum(lengths[i] for i in members)
            want = len(members) / size * total / (steps * ratio)
            if len(members) % size or abs(tokens - want) > 1e-2 * want:
                bad.append(f"{n // size}x{size}: ratio {ratio} on {members} ({tokens} "
                           f"tokens, {want:.2f} for per-micro-batch normalisation)")
    return bad


@pytest.mark.parametrize("loss_type", sorted(SPLIT))
def test_the_split_probe_as_measured(loss_type, engine):
    """Each loss type's c x D, on the window and on its length-swapped twin, is trl's
    documented advantage times ``D`` times ``token_weight`` (derived from trl's loss,
    not from the probe): a token's weight is independent of its sequence's length
    everywhere but ``grpo`` and ``sapo``, whose FAIL names the 6x of a 1-token
    completion's token over a 6-token one's. ``bnpo`` normalises each micro-batch by
    its own tokens: FAIL, and its split coefficients are exactly that normaliser's.
    exactstep's target PASSes."""
    result = probe(loss_type, "policy_split")
    assert result.status == SPLIT[loss_type], (MEASURED, result.observed)
    n = 2 * K
    for window, values in ((split_window(), result.expected_values[:n]),
                           (split_window(SWAPPED_LENGTHS), result.observed_values[-n:])):
        lengths = [len(c) for group in window.completions for c in group]
        want = [a * window.tokens * token_weight(loss_type, m, n, window.tokens, 6)
                for a, m in zip([a for g in window.rewards for a in trl_group_scaled(g)],
                                lengths, strict=True)]
        # recovered at the probe's 3.4e-4 of the largest; three times that here
        assert values == pytest.approx(want, rel=0, abs=1e-3 * max(map(abs, want))), \
            MEASURED
    if loss_type in ("grpo", "sapo"):
        assert "length^-1.00 (a 1-token completion's token 6.00x a 6-token" in \
            result.observed
        assert result.fix.startswith("a token's weight goes as its sequence's length^-1.00 "
                                     "(a 1-token completion's token counts 6.0x a 6-token "
                                     "one's): the loss normalises each sequence by its "
                                     "own length")
    else:
        assert "length^+0.00 (a 1-token completion's token 1.00x" in result.observed
    if loss_type == "bnpo":
        assert per_microbatch_tokens(result, split_window()) == []
        scale = [float(v) for v in re.findall(r"scale ([0-9.]+)", result.observed)]
        assert all(abs(v - 1.0) > 0.02 for v in scale), result.observed
        assert result.fix.startswith("normalise once per window")
    assert run_probe(PROBES["policy_split"], engine).status == PASS


def test_the_per_microbatch_check_tells_other_normalisers_apart():
    """Negative controls of ``per_microbatch_tokens``: coefficients divided again by the
    accumulation steps, or each completion's by its own length (a per-sequence mean),
    are not per-micro-batch normalisation."""
    from types import SimpleNamespace

    window = split_window()
    lengths = [len(c) for group in window.completions for c in group]
    whole = [a / window.tokens for group in window.rewards for a in trl_group_scaled(group)]
    n = len(whole)
    twice = [w / (n // size) for size in (4, 2) for w in whole]
    per_sequence = [w * window.tokens / (n * m) for _ in (4, 2)
                    for w, m in zip(whole, lengths, strict=True)]
    for observed in (twice, per_sequence):
        fake = SimpleNamespace(observed_values=observed, expected_values=whole * 2)
        assert per_microbatch_tokens(fake, window) != []
