"""The rollout program (Q1-Q4): a window of prompts becomes a window of trajectories.

Before the window is planned (``UpdateEngine(program=)``), each example of each
micro-batch is split into its prompt and reference response; ``K`` responses are
sampled at the window's parameters (``generation.sample_window``: addressed draws, the
window's rows batched with a key-value cache, eval mode, no gradients), scored by the
declared reward, and given advantages by the declared baseline over the whole window. Each trajectory becomes one row: the prompt
as context, its scored tokens as targets, each with its coefficient (1 teacher-forced,
the advantage when sampled, plus k3's term); ``objective.policy_plan`` turns those into
the window's S / D. The baseline's state moves only when the window commits (U4).
Design and derivations: docs/design/families.md#familiespolicyrolloutspy (Q1-Q4, U4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from exactstep.errors import ConfigError, DataError
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.regressor import Regressor
from exactstep.families.policy.rewards import Reward, Scored
from exactstep.generation.config import GenerationConfig
from exactstep.generation.prompts import Request, example_ids, response_batch, split_example
from exactstep.generation.sampler import (
    Continuation,
    SampleRequest,
    log_softmax64,
    prompt_batch,
    sample_window,
)
from exactstep.objective.policy import PolicyRows
from exactstep.rows.batch import Batch
from exactstep.rows.example import Example
from exactstep.state.rng import isolated
from exactstep.update.disposition import Disposition, Outcome


def advantages(rewards: np.ndarray, baseline: str, state_value: float | None, std_eps: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """``(baselines, advantages)`` ``[P, K]`` for rewards ``[P, K]`` (float64).

    ``none`` and ``learned`` (its ``b_t`` are per token, subtracted later): 0.
    ``moving_average``: ``state_value`` (the state before this window; 0
    before the first commit). ``leave_one_out``: the mean of the other ``K - 1``
    rewards of the same prompt. ``group_mean_with_self``: the mean of all ``K``,
    the scored one included; ``group_normalized``: that, and the advantage divided by
    the group's standard deviation (population) plus ``std_eps``."""
    P, K = rewards.shape
    if baseline in ("none", "learned"):
        base = np.zeros_like(rewards)
    elif baseline == "moving_average":
        base = np.full_like(rewards, 0.0 if state_value is None else state_value)
    elif baseline == "leave_one_out":
        base = (rewards.sum(axis=1, keepdims=True) - rewards) / (K - 1)
    else:
        base = np.repeat(rewards.mean(axis=1, keepdims=True), K, axis=1)
    adv = rewards - base
    if baseline == "group_normalized":
        adv = adv / (rewards.std(axis=1, keepdims=True) + std_eps)
    return base, adv


class PolicyRollouts:
    """The family's ``WindowProgram``: rollouts, rewards, baselines, trajectories.

    ``examples``: the training split (the window's segments name their examples by
    id). ``reference``: the frozen reference policy for ``policy.kl`` (or None).
    """

    def __init__(self, policy: PolicyConfig, generation: GenerationConfig, *, seed: int,
                 seq_len: int, examples: Sequence[Example], reward: Reward,
                 stop_ids: Sequence[int], decode: Any, reference: torch.nn.Module | None = None,
                 source_pad_id: int = 0, columns: Sequence[str] = ()) -> None:
        self.policy, self.generation, self.seed, self.seq_len = policy, generation, seed, seq_len
        self.examples = {e.example_id: e for e in examples}
        self.reward = reward
        self.stop_ids = tuple(int(s) for s in stop_ids)
        self.decode = decode
        self.reference = reference
        self.source_pad_id = source_pad_id  # pads encoder sides (encoder-decoder families)
        self.columns = tuple(columns)  # the examples' declared columns a reward sees
        self._components: dict[str, list[float]] = {}
        self.moving_average: float | None = None  # the baseline's state (S2), committed only
        self.regressor = Regressor(policy.regressor_lr) if policy.baseline == "learned" else None
        self._regression: dict = {}
        self._window_mean: float | None = None
        self.records: list[dict] = []  # the last window's samples, for the journal

    # -- WindowProgram ------------------------------------------------------------------

    def prepare(self, model: torch.nn.Module, batches: Sequence[Batch], *, clock: int,
                window: int, device: torch.device, reducer: Any = None
                ) -> tuple[list[Batch], dict]:
        delta = self.policy.delta(clock) if self.policy.mixer else None
        groups = [[self.request(eid, delta) for eid in example_ids(b, m)]
                  for m, b in enumerate(batches)]
        flat = [r for group in groups for r in group]
        sampled = delta is None or delta > 0
        K = self.generation.samples if sampled else 1
        conts = self.rollouts(model, flat, window, device, K) if sampled else \
            [[Continuation((), (), True)] for _ in flat]
        rewards = self.score_window(flat, conts, window, K)
        ref_logps = [[self.reference_logprobs(r, c, device) for c in cs]
                     for r, cs in zip(flat, conts, strict=True)]
        shaped = rewards.copy()
        if self.policy.kl == "k1":  # -beta * sum_t (log pi - log pi_ref), in the reward
            for i, cs in enumerate(conts):
                for k, c in enumerate(cs):
                    shaped[i, k] -= self.policy.beta * math.fsum(
                        a - b for a, b in zip(c.logprobs, ref_logps[i][k], strict=True))
        base, adv = advantages(shaped, self.policy.baseline, self.moving_average,
                               self.policy.std_eps)
        if not sampled:
            adv[:] = 0.0
        # every rank joins, an empty share too (D2): its rewards add nothing
        self._window_mean = self.global_mean(shaped, reducer) if sampled else None
        learned = self.learned_baselines(model, flat, conts, shaped, device, reducer) \
            if self.regressor is not None and sampled else None
        out, cursor = [], 0
        self.records = []
        for m, group in enumerate(groups):
            trajectories = []
            for r in group:
                for k, c in enumerate(conts[cursor]):
                    b, a = base[cursor, k], adv[cursor, k]
                    per_token = None
                    if learned is not None:  # b_t per sampled token; the record's mean
                        per_token = learned[cursor][k]
                        b = math.fsum(per_token) / len(per_token) if per_token else 0.0
                        a = shaped[cursor, k] - b
                    coeffs = [1.0] * len(r.forced) + self.sampled_coefficients(
                        adv[cursor, k], c, ref_logps[cursor][k], per_token)
                    trajectories.append((r, k, c, coeffs))
                    self.records.append(self.record(window, r, k, c, rewards[cursor, k],
                                                    b, a) | self.annotation(
                        r, c, cursor * K + k, ref_logps[cursor][k]))
                cursor += 1
            out.append(self.trajectory_batch(trajectories, m))
        gather = getattr(reducer, "gather", None) if reducer is not None else None
        if gather is not None and getattr(reducer, "world_size", 1) > 1:
            self.records = [r for part in gather(self.records) for r in part]  # every rank's
        records = self.records  # the whole window's, every rank's (the ledger's figures)
        n = len(records)
        info = {"estimator": "policy", "prompts": n // K, "samples": n,
                "sampled_tokens": sum(r["tokens"] for r in records),
                "reward_mean": math.fsum(r["reward"] for r in records) / n if n else None,
                "advantage_abs_mean": (math.fsum(abs(r["advantage"]) for r in records) / n
                                       if n else None)}
        info.update(self.window_figures(records, K))
        if delta is not None:
            info["delta"] = delta
        if self.policy.baseline == "moving_average":
            info["baseline_state"] = self.moving_average
        if learned is not None:
            info.update(self._regression)
        return out, info

    def learned_baselines(self, model: torch.nn.Module, flat: Sequence[Request],
                          conts: Sequence[Sequence[Continuation]], shaped: np.ndarray,
                          device: torch.device, reducer: Any) -> list[list[list[float]]]:
        """MIXER's ``b_t`` for each sampled token of each prompt's ``K`` samples (at the
        regressor's committed parameters), and the regressor's pending step on this
        window's ``(h_t, R)`` pairs (``families.policy.regressor``)."""
        states = [self.regressor.states(model, r.context, [c.tokens for c in cs], device,
                                        source=r.source, source_pad_id=self.source_pad_id)
                  for r, cs in zip(flat, conts, strict=True)]
        out = [[self.regressor.predict(s).tolist() for s in group] for group in states]
        self._regression = self.regressor.prepare_step(
            [s for group in states for s in group],
            [float(shaped[i, k]) for i, group in enumerate(states) for k in range(len(group))],
            reducer)
        return out

    def close(self, disposition: Disposition) -> None:
        """The moving average takes the window's mean reward only if it committed (U4)."""
        if self.regressor is not None:  # the learned baseline: its step commits with U4
            self.regressor.step(disposition.outcome is Outcome.COMMITTED)
        if disposition.outcome is not Outcome.COMMITTED or self._window_mean is None:
            return
        if self.policy.baseline == "moving_average":
            d = self.policy.decay
            self.moving_average = (self._window_mean if self.moving_average is None
                                   else d * self.moving_average + (1 - d) * self._window_mean)

    def state_dict(self) -> dict:
        out: dict = {"moving_average": self.moving_average}
        if self.regressor is not None:
            out["regressor"] = self.regressor.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        value = state.get("moving_average")
        self.moving_average = None if value is None else float(value)
        if self.regressor is not None:
            self.regressor.load_state_dict(state.get("regressor", {}))

    # -- steps --------------------------------------------------------------------------

    def request(self, example_id: int, delta: int | None) -> Request:
        example = self.examples.get(example_id)
        if example is None:
            raise DataError(f"policy: the window names example {example_id}, which is not in "
                            "the training split")
        prompt, reference = split_example(example, self.policy.over)
        keep = len(reference) if delta is not None and delta <= 0 else (
            0 if delta is None else max(0, len(reference) - delta))
        forced = reference[:keep]
        longest = len(prompt) + len(forced) + (self.generation.max_new_tokens
                                               if keep < len(reference) or delta is None else 0)
        if longest - 1 > self.seq_len:
            raise ConfigError(
                f"policy: example {example_id}'s rollout can reach {longest} tokens (prompt "
                f"{len(prompt)}, teacher-forced {len(forced)}, generation.max_new_tokens "
                f"{self.generation.max_new_tokens}), longer than a row of batch.seq_len = "
                f"{self.seq_len} (+1); raise batch.seq_len or lower generation.max_new_tokens")
        source = getattr(example, "source", None)
        return Request(example_id, prompt, reference, forced,
                       None if source is None else tuple(int(t) for t in source))

    def rollouts(self, model: torch.nn.Module, flat: Sequence[Request], window: int,
                 device: torch.device, samples: int) -> list[list[Continuation]]:
        """Each request's ``samples`` continuations of its context, the whole window in
        batches of ``generation.batch_rows`` rows (``sample_window``, Q1)."""
        return sample_window(model, [SampleRequest(r.example_id, r.context, r.source)
                                     for r in flat], self.generation, seed=self.seed,
                             window=window, stop_ids=self.stop_ids, device=device,
                             samples=samples, source_pad_id=self.source_pad_id)

    def scored(self, r: Request, c: Continuation) -> Scored:
        """What a reward sees of one sample (an encoder-decoder's prompt: its source)."""
        return Scored(r.prompt if r.source is None else r.source, r.forced + c.tokens,
                      r.reference, frozenset(self.stop_ids), self.decode)

    def score_window(self, flat: Sequence[Request], conts: Sequence[Sequence[Continuation]],
                     window: int, K: int) -> np.ndarray:
        """The window's rewards ``[P, K]`` (float64): the declared reward(s) called once
        on this rank's batch of samples (``Rewards.score_batch``), each sample seeing its
        example's declared columns; each term's values kept for the journal."""
        batch, wheres, owners = [], [], []
        for r, cs in zip(flat, conts, strict=True):
            for k, c in enumerate(cs):
                batch.append(self.scored(r, c))
                wheres.append(f"window {window}, example {r.example_id}, sample {k}")
                owners.append(r.example_id)
        totals, self._components = self.reward.score_batch(batch, wheres,
                                                           self.column_lists(owners))
        return np.array(totals, dtype=np.float64).reshape(len(flat), K)

    def column_lists(self, example_ids: Sequence[int]) -> dict[str, list]:
        """Each declared column as a list over the batch (trl's keyword form)."""
        out: dict[str, list] = {name: [] for name in self.columns}
        for eid in example_ids:
            values = self.examples[eid].columns or {}
            for name in self.columns:
                if name not in values:
                    raise DataError(f"policy: example {eid} has no column {name!r}, which "
                                    "data.columns declares; give every example that field")
                out[name].append(values[name])
        return out

    def annotation(self, r: Request, c: Continuation, index: int, ref: list[float]) -> dict:
        """A journal record's text and figures: the decoded prompt and completion (up to
        its stop token, which ``stopped`` records), each
        reward term's value, the sum of the sampled tokens' entropies (the sampler's
        own logits) and, with ``policy.kl``, of their k1 and k3 estimates."""
        s = self.scored(r, c)
        out: dict = {"prompt": s.decode(s.prompt),
                     "completion": s.decode(s.content(s.response)),  # to the stop token
                     "rewards": {name: values[index]
                                 for name, values in self._components.items()},
                     "entropy_sum": (math.fsum(c.entropies)
                                     if len(c.entropies) == len(c.tokens) else None)}
        if self.policy.kl != "none":
            out["kl_k1_sum"] = math.fsum(lp - lr for lp, lr in
                                         zip(c.logprobs, ref, strict=True))
            out["kl_k3_sum"] = math.fsum(math.exp(lr - lp) - (lr - lp) - 1.0 for lp, lr in
                                         zip(c.logprobs, ref, strict=True))
        return out

    def window_figures(self, records: Sequence[dict], K: int) -> dict:
        """The ledger's figures over every rank's records: the mean entropy and (with
        ``policy.kl``) the mean k1 / k3 per sampled token, and how many of the window's
        groups (each prompt's ``K`` consecutive records) have every advantage 0."""
        tokens = sum(r["tokens"] for r in records)
        groups = [records[i:i + K] for i in range(0, len(records), K)]
        out: dict = {"groups": len(groups),
                     "zero_advantage_groups": sum(all(r["advantage"] == 0.0 for r in g)
                                                  for g in groups)}
        known = all(r.get("entropy_sum") is not None for r in records)
        out["entropy_mean"] = (math.fsum(r["entropy_sum"] for r in records) / tokens
                               if tokens and known else None)
        if self.policy.kl != "none":
            for key in ("kl_k1", "kl_k3"):
                out[key] = (math.fsum(r[f"{key}_sum"] for r in records) / tokens
                            if tokens else None)
        return out

    @torch.no_grad()
    def reference_logprobs(self, r: Request, c: Continuation, device: torch.device
                           ) -> list[float]:
        """``log pi_ref`` of each sampled token (float64), from the frozen reference on
        the trajectory's own row (eval mode, no gradients); empty without ``kl``."""
        if self.reference is None or not c.tokens:
            return []
        tokens = torch.tensor([list(r.context + c.tokens)], dtype=torch.int64, device=device)
        with isolated(self.reference):
            hidden = self.reference(prompt_batch(tokens[:, :-1], r.source,
                                                 self.source_pad_id))  # [1, L-1, H]
            start = len(r.context) - 1
            logits = self.reference.logits(hidden[:, start:, :])[0].float().cpu().numpy()
        return [float(log_softmax64(logits[i])[t]) for i, t in enumerate(c.tokens)]

    def sampled_coefficients(self, advantage: float, c: Continuation, ref: list[float],
                             baselines: list[float] | None = None) -> list[float]:
        """Each sampled token's coefficient on its cross entropy: minus the REINFORCE
        term's ``A`` becomes ``A`` on ``-log pi`` (``A - b_t`` per token with the learned
        baseline, ``advantage`` then being the shaped reward); k3's gradient adds
        ``-beta (1 - r)`` with ``r = pi_ref / pi`` at the window's parameters (its
        derivative in ``log pi`` is ``1 - r``); ``k3_corrected`` (k3 times the ratio
        ``pi / sg(pi)``) adds ``-beta (k3 + 1 - r) = -beta (log pi - log pi_ref)``."""
        coeffs = [float(advantage)] * len(c.tokens) if baselines is None else \
            [float(advantage) - b for b in baselines]
        if self.policy.kl == "k3":
            coeffs = [a - self.policy.beta * (1.0 - math.exp(lr - lp))
                      for a, lp, lr in zip(coeffs, c.logprobs, ref, strict=True)]
        elif self.policy.kl == "k3_corrected":  # k3 * pi / sg(pi): -beta (log pi - log pi_ref)
            coeffs = [a - self.policy.beta * (lp - lr)
                      for a, lp, lr in zip(coeffs, c.logprobs, ref, strict=True)]
        return coeffs

    def global_mean(self, rewards: np.ndarray, reducer: Any) -> float | None:
        """The window's mean reward over every rank (the moving average's input);
        ``None`` when no rank sampled anything. A rank whose share is empty joins
        the all-reduce with nothing to add (D2)."""
        total = torch.tensor([math.fsum(rewards.ravel().tolist()), float(rewards.size)],
                             dtype=torch.float64)
        if reducer is not None and getattr(reducer, "world_size", 1) > 1:
            total = reducer.sum(total)
        s, n = total.tolist()
        return s / n if n else None

    def record(self, window: int, r: Request, k: int, c: Continuation, reward: float,
               baseline: float, advantage: float) -> dict:
        return {"window": window, "example": r.example_id, "sample": k,
                "tokens": len(c.tokens), "stopped": c.stopped, "reward": reward,
                "baseline": baseline, "advantage": advantage}

    def trajectory_batch(self, trajectories: list[tuple[Request, int, Continuation,
                                                        list[float]]], microbatch: int
                         ) -> Batch:
        """One row per trajectory (prompt, teacher-forced and sampled tokens), padded to
        the longest; targets are the scored tokens, row-aligned (R1); ``meta["policy"]``
        holds each row's coefficient and trajectory index."""
        if not trajectories:
            empty = torch.zeros((0, 1), dtype=torch.int64)
            return Batch(input_ids=empty, labels=empty.clone(), position_ids=empty.clone(),
                         segment_ids=torch.zeros((0, 1), dtype=torch.int32), segments=(),
                         meta={"policy": PolicyRows.empty((0, 1))})
        paired = trajectories[0][0].source is not None  # an encoder side to pad
        base = response_batch([(r, r.forced + c.tokens, k, True)
                               for r, k, c, _ in trajectories],
                              self.source_pad_id if paired else 0)
        B, T = base.input_ids.shape
        coefficient = torch.zeros((B, T), dtype=torch.float64)
        sampled = torch.zeros((B, T), dtype=torch.bool)
        trajectory = torch.full((B, T), -1, dtype=torch.int64)
        for b, (r, _, c, coeffs) in enumerate(trajectories):
            first = len(r.prompt) - 1  # the column whose target is the first scored token
            scored = len(r.forced) + len(c.tokens)
            coefficient[b, first:first + scored] = torch.tensor(coeffs, dtype=torch.float64)
            sampled[b, first + len(r.forced):first + scored] = True
            trajectory[b, first:first + scored] = b
        return replace(base, meta={"policy": PolicyRows(coefficient, trajectory, sampled)})
