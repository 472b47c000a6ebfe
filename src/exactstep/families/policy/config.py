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
    constant``). ``kl``: ``none``, ``k1`` (``beta * sum_t (log pi - log pi_ref)``
    subtracted from each reward) or ``k3`` (``beta * (r - log r - 1)``, ``r = pi_ref /
    pi``, a loss term per sampled token) against ``reference``, a checkpoint directory
    whose weights are the frozen reference policy (identified by its manifest's digest,
    never trainable state); with ``model.lora``, empty or ``"base"`` is the policy's own
    frozen base (its adapters disabled, no second copy). ``mixer``: MIXER's
    curriculum: the last ``delta(clock)`` reference tokens are sampled and trained by
    REINFORCE, the ones before them teacher-forced; ``delta(c) = min(delta_max,
    delta_start + delta_step * floor(c / delta_every))`` on committed windows (U5);
    without ``mixer`` the whole response is sampled.
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
    kl: Literal["none", "k1", "k3"] = "none"
    beta: float = 0.0
    reference: str = ""
    mixer: bool = False
    delta_start: int = 1
    delta_step: int = 1
    delta_every: int = 100
    delta_max: int = 1 << 20

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
        if self.reward not in BUILT_IN_REWARDS and ":" not in self.reward:
            raise ConfigError(
                f"policy.reward must be one of {', '.join(BUILT_IN_REWARDS)} or "
                f"'module:function'; got {self.reward!r}")
        self.check_rewards()
        if self.kl != "none" and self.beta == 0.0:
            raise ConfigError(f"policy.kl = {self.kl!r} needs policy.beta > 0 (its "
                              "coefficient); set policy.beta, or policy.kl = \"none\"")

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
                     "normalizer": self.normalizer, "credit": "sequence_reward_every_token",
                     "kl": self.kl}
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
            out["kl_estimator"] = ("k1 in the reward: -beta * sum_t (log pi - log pi_ref)"
                                   if self.kl == "k1" else
                                   "k3 loss term: beta * (r - log r - 1), r = pi_ref / pi")
        if self.mixer:
            out["mixer"] = {"delta_start": self.delta_start, "delta_step": self.delta_step,
                            "delta_every": self.delta_every, "delta_max": self.delta_max,
                            "clock": "committed_windows"}
        return out
