"""Rewards as declared functions (Q2): built in, or a user's ``module:function``.

A reward scores a sampled response against the example's reference response. The
built-in ones read token ids: ``exact_match`` (the response, stop token included,
equals the reference), ``token_f1`` (bag-of-tokens F1 of the contents) and
``ngram_overlap`` (the mean over ``n = 1..N`` of clipped ``n``-gram F1). A user's
function in ``policy.rewards`` is called once per window's batch as trl calls one
(``f(prompts, completions, completion_ids=, references=, **columns) -> list[float]``,
each keyword a list over the batch, the dataset's declared columns among them; a
completion is its text up to the stop token, for chats trl's one assistant message); the
one-reward form ``policy.reward`` keeps its per-sample call ``f(prompt=, completion=,
reference=)``. ``Rewards`` sums ``weight x value`` over its terms. Each function's
identity (name, SHA-256 of its source, weight) goes into the manifest, and a failure is
one ``error:`` line naming the sample.
Design: docs/design/families.md#familiespolicyrewardspy (Q2).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import math
import numbers
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exactstep.errors import ConfigError, RewardError


@dataclass(frozen=True)
class Scored:
    """What a reward sees of one sample: the token ids of the prompt, the response
    (its stop token included when it drew one), the reference response (with its stop
    token), the stop token ids, and a decoder of ids to text."""

    prompt: Sequence[int]
    response: Sequence[int]
    reference: Sequence[int]
    stop_ids: frozenset[int]
    decode: Callable[[Sequence[int]], str]

    def content(self, ids: Sequence[int]) -> list[int]:
        """``ids`` up to their first stop token (excluded)."""
        out = []
        for i in ids:
            if i in self.stop_ids:
                break
            out.append(int(i))
        return out


def exact_match(s: Scored) -> float:
    """1 when the response is the reference, its stop token included, else 0."""
    return float([int(i) for i in s.response] == [int(i) for i in s.reference])


def token_f1(s: Scored) -> float:
    """Bag-of-tokens F1 of the two contents (1 when both are empty)."""
    return _f1(Counter(s.content(s.response)), Counter(s.content(s.reference)))


def ngram_overlap(s: Scored, n: int) -> float:
    """The mean over ``m = 1..n`` of the clipped ``m``-gram F1 of the two contents,
    over the orders either content is long enough to have (1 when both are empty)."""
    got, want = s.content(s.response), s.content(s.reference)
    scores = [_f1(_ngrams(got, m), _ngrams(want, m)) for m in range(1, n + 1)
              if len(got) >= m or len(want) >= m]
    return sum(scores) / len(scores) if scores else 1.0


def _ngrams(ids: list[int], m: int) -> Counter:
    return Counter(tuple(ids[i:i + m]) for i in range(len(ids) - m + 1))


def _f1(got: Counter, want: Counter) -> float:
    if not got and not want:
        return 1.0
    overlap = sum((got & want).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / sum(got.values()), overlap / sum(want.values())
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Reward:
    """A declared reward: ``score(scored, where)`` and its manifest ``identity``;
    ``batched``: a user's function called once per batch with lists (trl's form)."""

    name: str
    fn: Callable[[Scored], Any]
    identity: dict
    user: bool
    batched: bool = False
    conversational: bool = False  # completions as trl's one assistant message each

    def score_batch(self, batch: Sequence[Scored], wheres: Sequence[str],
                    columns: dict[str, list] | None = None) -> tuple[list[float], dict]:
        """``(totals, components)`` of a batch: this reward alone, weight 1 (the
        one-reward form of ``Rewards.score_batch``)."""
        values = self.values(batch, wheres, columns or {})
        return values, {self.name: values}

    def values(self, batch: Sequence[Scored], wheres: Sequence[str],
               columns: dict[str, list]) -> list[float]:
        """One finite float per sample of ``batch`` (``wheres[i]`` names sample ``i``:
        window, example, sample); ``RewardError`` naming the first bad one."""
        if not self.batched:
            return [self.score(s, w) for s, w in zip(batch, wheres, strict=True)]
        if not batch:
            return []
        where = f"the batch of {wheres[0]} .. {wheres[-1]}"
        texts = [s.decode(s.content(s.response)) for s in batch]  # up to the stop token
        kwargs = {"prompts": [s.decode(s.prompt) for s in batch],
                  "completions": ([[{"role": "assistant", "content": t}] for t in texts]
                                  if self.conversational else texts),
                  "completion_ids": [[int(i) for i in s.response] for s in batch],
                  "references": [s.decode(s.reference) for s in batch], **columns}
        try:
            out = self.fn(**kwargs)
        except Exception as exc:  # a user's function: any failure is theirs to see
            raise RewardError(f"policy.rewards {self.name!r} raised {type(exc).__name__}: "
                              f"{exc} on {where}; fix the function (nothing was committed "
                              "for this window)") from None
        if isinstance(out, str | bytes) or not hasattr(out, "__len__") \
                or len(out) != len(batch):
            got = f"{len(out)} values" if hasattr(out, "__len__") and not isinstance(
                out, str | bytes) else f"{type(out).__name__}"
            raise RewardError(f"policy.rewards {self.name!r} returned {got} for a batch of "
                              f"{len(batch)} on {where}; return one finite number per "
                              "completion")
        return [self.finite(v, w) for v, w in zip(list(out), wheres, strict=True)]

    def finite(self, value: Any, where: str) -> float:
        """``value`` as a float, or ``RewardError`` naming ``where``."""
        key = "policy.rewards" if self.batched else "policy.reward"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"{key} {self.name!r} returned {type(value).__name__} "
                              f"{value!r:.60} on {where}; a reward is one finite number per "
                              "sample")
        if not math.isfinite(float(value)):
            raise RewardError(f"{key} {self.name!r} returned {value} on {where}; a "
                              "reward must be finite")
        return float(value)

    def score(self, s: Scored, where: str) -> float:
        """The reward of one sample, a finite float; ``RewardError`` (naming ``where``:
        the window, example and sample) when the function raises or returns anything
        else."""
        try:
            value = (self.fn(prompt=s.decode(s.prompt), completion=s.decode(s.response),
                             reference=s.decode(s.reference)) if self.user else self.fn(s))
        except Exception as exc:  # a user's function: any failure is theirs to see
            raise RewardError(f"policy.reward {self.name!r} raised {type(exc).__name__}: "
                              f"{exc} on {where}; fix the function (nothing was committed "
                              "for this window)") from None
        return self.finite(value, where)


def load_reward(name: str, ngram: int, *, batched: bool = False,
                columns: Sequence[str] = (), conversational: bool = False) -> Reward:
    """The reward ``name`` declares: a built-in, or ``module:function`` imported now
    (a ``ConfigError`` naming what is missing before anything is written). ``batched``:
    a user's function is called per batch (``policy.rewards``), and then every
    keyword it requires must be one it is given: the batch's own or one of the declared
    ``columns`` (``data.columns``); ``conversational``: each completion is given as
    trl gives a chat dataset's, ``[{"role": "assistant", "content": text}]``."""
    if name == "exact_match":
        return Reward(name, exact_match, {"name": name, "kind": "built_in"}, False)
    if name == "token_f1":
        return Reward(name, token_f1, {"name": name, "kind": "built_in"}, False)
    if name == "ngram_overlap":
        return Reward(name, lambda s: ngram_overlap(s, ngram),
                      {"name": name, "kind": "built_in", "ngram": ngram}, False)
    module_name, _, function_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"policy.reward {name!r}: cannot import {module_name!r} ({exc}); "
                          "put the module on the Python path") from None
    fn = getattr(module, function_name, None)
    if not callable(fn):
        raise ConfigError(f"policy.reward {name!r}: {module_name!r} has no function "
                          f"{function_name!r}")
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        raise ConfigError(f"policy.reward {name!r}: its source cannot be read, so its "
                          "identity cannot be recorded; define it in a .py file") from None
    digest = hashlib.sha256(source.encode("utf-8")).hexdigest()
    if batched:
        require_keywords(name, fn, columns)
    return Reward(name, fn, {"name": name, "kind": "user", "source_sha256": digest,
                             "call": "per_batch" if batched else "per_sample"},
                  True, batched, conversational)


#: What a batched user function is given besides the declared columns (trl's names,
#: and the reference response).
BATCH_KEYWORDS = ("prompts", "completions", "completion_ids", "references")


def require_keywords(name: str, fn: Callable, columns: Sequence[str]) -> None:
    """``ConfigError`` when ``fn`` requires a keyword it will not be given: a column
    the data does not declare (``data.columns``), named with what to change."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    given = set(BATCH_KEYWORDS) | set(columns)
    for p in parameters:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty:
            continue
        if p.name not in given:
            declared = ", ".join(columns) or "none"
            raise ConfigError(
                f"policy.rewards {name!r} asks for {p.name!r}, which is neither one of "
                f"{', '.join(BATCH_KEYWORDS)} nor a declared column (data.columns: "
                f"{declared}); add {p.name!r} to data.columns or give the parameter a "
                "default")


@dataclass(frozen=True)
class Rewards:
    """A weighted list of rewards: the total is ``sum_j weight_j x value_j`` per
    sample; ``components`` keeps each term's own value (``rollouts.jsonl``)."""

    terms: tuple[tuple[Reward, float], ...]

    @property
    def identity(self) -> list[dict]:
        return [{**reward.identity, "weight": weight} for reward, weight in self.terms]

    def score_batch(self, batch: Sequence[Scored], wheres: Sequence[str],
                    columns: dict[str, list] | None = None) -> tuple[list[float], dict]:
        """``(totals, components)``: each term called once on the batch, the totals
        summed in the declared order (``math.fsum`` of the weighted values)."""
        components = {reward.name: reward.values(batch, wheres, columns or {})
                      for reward, _ in self.terms}
        totals = [math.fsum(weight * components[reward.name][i]
                            for reward, weight in self.terms) for i in range(len(batch))]
        return totals, components


def load_rewards(entries: Sequence[dict], ngram: int, columns: Sequence[str] = (),
                 conversational: bool = False) -> Rewards:
    """``policy.rewards``: each ``{name, weight}`` loaded (``load_reward``, batched)."""
    terms = []
    for entry in entries:
        terms.append((load_reward(entry["name"], ngram, batched=True, columns=columns,
                                  conversational=conversational), float(entry["weight"])))
    return Rewards(tuple(terms))


def sampled_text(decode: Callable[[Sequence[int]], str], vocab_size: int
                 ) -> Callable[[Sequence[int]], str]:
    """``decode`` for sampled ids: a model whose vocabulary is padded past the
    tokenizer's (a 151,936-row head over a smaller tokenizer) draws those rows too, as
    its own distribution says; they have no text, so each is written ``<id:N>`` in the
    prompt, completion and reference a reward and the journal see, never dropped and
    never an error (the ids themselves are what the objective trains)."""

    def text(ids: Sequence[int]) -> str:
        out, run = [], []
        for i in ids:
            if 0 <= int(i) < vocab_size:
                run.append(int(i))
                continue
            if run:
                out.append(decode(run))
                run = []
            out.append(f"<id:{int(i)}>")
        if run:
            out.append(decode(run))
        return "".join(out)

    return text

