"""The ``[policy]`` section (R8, Q2-Q4): sequence-level policy training, declared.

Light (no torch at import), so the run configuration can be read without loading the
training stack; the rollout program is ``rollouts.py``, the objective ``objective.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from exactstep.errors import ConfigError
from exactstep.ranges import UNIT, above, at_least, between, check, check_finite

#: Baselines that are a function of state only, never of the sampled action (Q3).
UNBIASED = ("none", "moving_average", "leave_one_out", "learned")
#: Estimators offered under their own names: the group mean includes the sample it
#: scores, so its gradient is (K - 1) / K of REINFORCE's in expectation, and the
#: standard-deviation scaling is a per-group rescaling of the gradient (Q3).
BIASED = ("group_mean_with_self", "group_normalized")
BUILT_IN_REWARDS = ("exact_match", "token_f1", "ngram_overlap")

#: What each normaliser's expected update is, for the manifest (Q4): derivations in
#: docs/design/families.md#familiespolicyrolloutspy. N: the window's trajectories.
NORMALIZER_BIAS = {
    "token_mean": (
        "ratio estimator: D = the window's scored tokens, a random variable when response "
        "lengths vary, so E[S / D] != E[S] / E[D]; a token's weight 1 / (L_i + D_rest) "
        "falls with its own sequence's length L_i, so the expected update is the "
        "gradient of the length-weighted E[(R - b) w(L)], w(L) = E[1 / (L + D_rest)], "
        "not the true gradient's direction, and the baseline's term no longer cancels; "
        "a length-L sequence's tokens weigh about 1 - (L - m) / (N m) of the mean "
        "(m the mean length), so the bias vanishes as 1 / N: with lengths 1 to 8 "
        "(m = 4.5) an 8-token sequence's tokens weigh (1 + D_rest) / (8 + D_rest) of "
        "a 1-token one's, 0.67 at N = 4, 0.95 at N = 32; normalizer = \"constant\" "
        "is unbiased"),
    "sequence_mean": (
        "each trajectory's tokens share 1: a token of a length-L sequence weighs "
        "1 / (L N), so a 1-token completion's token counts 6x a 6-token one's; the "
        "expected update is grad E[(R - b) / L] (b at its mean, held fixed): the "
        "reward per token, not E[R]; positive advantages favour short responses, "
        "negative ones long; the bias does not vanish with N; normalizer = "
        "\"constant\" is unbiased"),
    "constant": (
        "unbiased: D is not random, so E[S / D] = E[S] / constant = N grad E[R] / "
        "constant for a baseline that never sees the sample (the true gradient's "
        "direction; the step grows with N, not with the tokens)"),
}
#: What each KL option's loss gradient is in expectation, for the manifest: ``r_t =
#: pi_ref / pi`` at sampled token ``t``, ``h_t`` its context, ``rho_t = log pi - log
#: pi_ref``; derivations in docs/design/families.md#familiespolicyrolloutspy.
KL_OVER_D = ("; times 1 / D: exact with normalizer = \"constant\", weighted as the "
             "reward is under token_mean and sequence_mean (normalizer_bias)")
KL_ESTIMATORS = {
    "k1": (
        "k1 in the reward: -beta * sum_t (log pi - log pi_ref) subtracted from each "
        "sequence's reward; every token's coefficient carries the whole sequence's "
        "log-ratio, so with a baseline that never sees the sample the expected loss "
        "gradient is beta * grad KL(pi || pi_ref) of the sequence distribution (the "
        "future tokens' log-ratios included): the reward-shaping KL exactly"),
    "k3": (
        "k3 loss term: beta * (r - log r - 1), r = pi_ref / pi, differentiated through "
        "pi: coefficient beta (1 - r_t) on grad log pi(y_t); E_pi[r grad log pi] = "
        "sum_y pi_ref grad log pi, so the expected loss gradient is beta * sum_t "
        "E_{h_t ~ pi}[grad KL(pi_ref(.|h_t) || pi(.|h_t))], the reverse direction "
        "KL(pi_ref || pi) per token, contexts held fixed; NOT grad KL(pi || pi_ref), "
        "which the reward-shaping KL intends (k3's value estimates KL(pi || pi_ref) "
        "without bias, its gradient does not): kl = \"k3_corrected\" corrects it"),
    "k3_corrected": (
        "k3 times the importance ratio pi / stopgrad(pi) (its value 1), differentiated "
        "through both: coefficient beta (k3 + 1 - r_t) = beta (log pi - log pi_ref)(y_t) "
        "on grad log pi(y_t); the expected loss gradient is beta * sum_t "
        "E_{h_t ~ pi}[grad KL(pi(.|h_t) || pi_ref(.|h_t))], KL(pi || pi_ref) per token "
        "with the contexts' distribution held fixed (trl's use_bias_correction_kl, "
        "DeepSeek-V3.2's unbiased KL estimate): beta * grad KL(pi || pi_ref) of the "
        "sequence distribution for one-token responses; for longer ones that gradient "
        "also weights grad log pi(y_t) by the later tokens' log-ratios sum_{s>t} "
        "rho_s, which only kl = \"k1\" carries"),
}


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """Sequence-level policy training (REINFORCE with a baseline; MIXER), declared.

    ``over``: the base family whose data and model are used: ``"chat"`` (the prompt is
    a conversation up to its last assistant turn, the reference that turn),
    ``"causal"`` (text; with MIXER the document's first tokens are the prompt) or
    ``"encdec"`` (source-target pairs on the encoder-decoder: the target side is sampled
    from ``BOS`` given the source, the pair's target the reference).
    ``reward``: ``exact_match``, ``token_f1``, ``ngram_overlap`` (up to ``ngram``-grams)
    or ``module:function`` (a user's function, its name and source hash in the
    manifest, called per sample). ``rewards``: instead, a list of ``{name, weight}``
    tables, each a built-in or ``module:function`` (called per batch, trl's form),
    the reward being ``sum weight x value`` (``reward`` then stays at its default). ``baseline``: ``none``, ``moving_average`` (``decay`` per committed
    window, in the checkpoint), ``leave_one_out`` (the mean of the prompt's other
    ``K - 1`` samples), ``learned`` (MIXER's regressor ``b_t = w . h_t + c`` on the
    policy's stop-gradient state before each sampled token, trained on its own squared
    error by its own Adam at ``regressor_lr``, stepped with committed windows, in the
    checkpoint); ``group_mean_with_self`` and ``group_normalized`` (also divided
    by the group's standard deviation plus ``std_eps``) are GRPO's estimators, named
    for what they are: biased (Q3). ``normalizer``: ``token_mean`` (every scored token
    of the window, all micro-batches and ranks), ``sequence_mean`` (each trajectory's
    tokens share 1, over every trajectory of the window) or ``constant`` (``D =
    constant``; the one unbiased for varying lengths: ``NORMALIZER_BIAS``). ``kl``:
    ``none``, ``k1`` (``beta * sum_t (log pi - log pi_ref)`` subtracted from each
    reward), ``k3`` (``beta * (r - log r - 1)``, ``r = pi_ref / pi``, a loss term per
    sampled token: its gradient is KL(pi_ref || pi)'s) or ``k3_corrected`` (k3 times
    the importance ratio: KL(pi || pi_ref)'s per-token gradient; ``KL_ESTIMATORS``)
    against ``reference``, a checkpoint directory
    whose weights are the frozen reference policy (identified by its manifest's digest,
    never trainable state); with ``model.lora``, empty or ``"base"`` is the policy's own
    frozen base (its adapters disabled, no second copy). ``mixer``: MIXER's
    curriculum: the last ``delta(clock)`` reference tokens are sampled and trained by
    REINFORCE, the ones before them teacher-forced; ``delta(c) = min(delta_max,
    delta_start + delta_step * floor(c / delta_every))`` on committed windows (U5);
    without ``mixer`` the whole response is sampled.
    ``epochs``: optimizer steps per rollout batch (PPO/GRPO's ``num_iterations``): the
    window's rollouts, drawn once at the parameters before its first step (Q1), are
    trained on ``epochs`` times, each step on the clipped surrogate ``-min(rho A,
    clip(rho, 1 - clip_ratio, 1 + clip_ratio_high) A)`` with ``rho = pi / pi_old``
    against the sampler's recorded log-probabilities; the first step is on-policy
    (``rho = 1`` exactly: the REINFORCE window's step itself). ``clip_ratio_high``: the
    upper clip (DAPO's asymmetric clip); 0 means ``clip_ratio``. All of a window's
    steps are one transaction (U3, U4).
    """

    over: Literal["chat", "causal", "encdec"] = "chat"
    reward: str = "exact_match"
    rewards: tuple[dict, ...] = ()
    ngram: int = 4
    baseline: Literal["none", "moving_average", "leave_one_out", "learned",
                      "group_mean_with_self", "group_normalized"] = "leave_one_out"
    decay: float = 0.9
    regressor_lr: float = 1e-2
    std_eps: float = 1e-6
    normalizer: Literal["token_mean", "sequence_mean", "constant"] = "token_mean"
    constant: float = 1.0
    kl: Literal["none", "k1", "k3", "k3_corrected"] = "none"
    beta: float = 0.0
    reference: str = ""
    mixer: bool = False
    delta_start: int = 1
    delta_step: int = 1
    delta_every: int = 100
    delta_max: int = 1 << 20
    epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_high: float = 0.0

    def __post_init__(self) -> None:
        check("policy.ngram", self.ngram, between(1, 16))
        check("policy.decay", self.decay, UNIT)
        check_finite("policy.regressor_lr", self.regressor_lr)
        check("policy.regressor_lr", self.regressor_lr, above(0.0))
        check("policy.std_eps", self.std_eps, at_least(0.0))
        check_finite("policy.constant", self.constant)
        check("policy.constant", self.constant, above(0.0))
        check_finite("policy.beta", self.beta)
        check("policy.beta", self.beta, at_least(0.0))
        check("policy.delta_start", self.delta_start, at_least(0))
        check("policy.delta_step", self.delta_step, at_least(0))
        check("policy.delta_every", self.delta_every, at_least(1))
        check("policy.delta_max", self.delta_max, at_least(0))
        check("policy.epochs", self.epochs, between(1, 1024))
        check_finite("policy.clip_ratio", self.clip_ratio)
        check("policy.clip_ratio", self.clip_ratio, between(0.0, 1.0, low_open=True))
        check_finite("policy.clip_ratio_high", self.clip_ratio_high)
        check("policy.clip_ratio_high", self.clip_ratio_high, at_least(0.0))
        if self.reward not in BUILT_IN_REWARDS and ":" not in self.reward:
            raise ConfigError(
                f"policy.reward must be one of {', '.join(BUILT_IN_REWARDS)} or "
                f"'module:function'; got {self.reward!r}")
        self.check_rewards()
        if self.kl != "none" and self.beta == 0.0:
            raise ConfigError(f"policy.kl = {self.kl!r} needs policy.beta > 0 (its "
                              "coefficient); set policy.beta, or policy.kl = \"none\"")

    @property
    def clip_high(self) -> float:
        """The upper clip ``epsilon_high`` (``clip_ratio`` unless set)."""
        return self.clip_ratio_high or self.clip_ratio

    def check_rewards(self) -> None:
        """``policy.rewards``: tables of a reward ``name`` and a finite ``weight``, each
        name once, never beside a ``policy.reward`` of its own."""
        if not self.rewards:
            return
        if self.reward != "exact_match":
            raise ConfigError(
                f"policy.reward = {self.reward!r} and policy.rewards are both set; give "
                f"one reward as policy.rewards = [{{name = {self.reward!r}, weight = 1.0}}] "
                "or drop policy.rewards")
        seen: set[str] = set()
        for i, entry in enumerate(self.rewards):
            key = f"policy.rewards.{i}"
            extra = sorted(set(entry) - {"name", "weight"})
            if extra or "name" not in entry or "weight" not in entry:
                raise ConfigError(f"{key} must be a table {{name = ..., weight = ...}}; "
                                  f"got keys {', '.join(sorted(entry)) or 'none'}")
            name, weight = entry["name"], entry["weight"]
            if not isinstance(name, str) or (name not in BUILT_IN_REWARDS and ":" not in name):
                raise ConfigError(f"{key}.name must be one of {', '.join(BUILT_IN_REWARDS)} "
                                  f"or 'module:function'; got {name!r}")
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                raise ConfigError(f"{key}.weight must be a number; got {weight!r}")
            check_finite(f"{key}.weight", float(weight))
            if name in seen:
                raise ConfigError(f"{key}: reward {name!r} is listed twice; give it once with "
                                  "the sum of its weights")
            seen.add(name)

    def delta(self, clock: int) -> int:
        """MIXER's sampled suffix length after ``clock`` committed windows."""
        return min(self.delta_max, self.delta_start + self.delta_step * (clock // self.delta_every))

    def describe(self) -> dict:
        """The manifest's record of the estimator (S1, Q2-Q4)."""
        out: dict = {"over": self.over, "baseline": self.baseline,
                     "baseline_depends_on_sample": self.baseline in BIASED,
                     "normalizer": self.normalizer,
                     "normalizer_bias": NORMALIZER_BIAS[self.normalizer],
                     "credit": "sequence_reward_every_token", "kl": self.kl}
        if self.baseline == "moving_average":
            out["decay"] = self.decay
        if self.baseline == "learned":
            out["regressor"] = {"form": "w . h_t + c on the final hidden state before each "
                                        "sampled token (stop-gradient)",
                                "loss": "squared error to the sequence's reward, mean over "
                                        "the window's sampled tokens",
                                "optimizer": "adam", "lr": self.regressor_lr,
                                "dtype": "float64", "clock": "committed_windows"}
        if self.baseline in BIASED:
            out["bias"] = ("the group mean includes the scored sample: the expected "
                           "gradient is (K - 1) / K of REINFORCE's")
            if self.baseline == "group_normalized":
                out["bias"] += ("; divided by the group's standard deviation + std_eps "
                                f"({self.std_eps}): each group's gradient rescaled")
        if self.normalizer == "constant":
            out["constant"] = self.constant
        if self.kl != "none":
            out["beta"] = self.beta
            out["kl_estimator"] = KL_ESTIMATORS[self.kl] + KL_OVER_D
        if self.mixer:
            out["mixer"] = {"delta_start": self.delta_start, "delta_step": self.delta_step,
                            "delta_every": self.delta_every, "delta_max": self.delta_max,
                            "clock": "committed_windows"}
        if self.epochs > 1:
            out["epochs"] = {
                "epochs": self.epochs, "clip_ratio": self.clip_ratio,
                "clip_ratio_high": self.clip_high,
                "surrogate": "-min(rho A, clip(rho, 1 - clip_ratio, 1 + clip_ratio_high) A) "
                             "per sampled token, S / D with the rollout batch's D on "
                             "every step",
                "ratio": "rho = exp(log pi - log pi_old), log pi at the step's parameters "
                         "(eval mode, float64 over the fp32 logits), log pi_old the "
                         "sampler's recorded float64 log-probability; the first step is "
                         "on-policy: rho = 1 exactly",
                "gradient": "A * rho on -log pi where the unclipped branch is the min "
                            "(ties included), 0 where the clipped one is",
                "rollouts": "drawn once per window, at the parameters before its first "
                            "step (Q1)",
                "transaction": "the window's steps commit together; a non-finite step "
                               "undoes every step of the window (U3, U4); a step whose "
                               "every token is clipped ends the window's steps",
                "clock": "committed_optimizer_steps"}
        return out
