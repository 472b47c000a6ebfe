"""The sampler: continuations drawn from the model with addressed draws (Q1).

``sample_group`` continues one prompt ``K`` times in one batch of ``K`` equal rows
(never beside another prompt's rows, so a window's packing and micro-batch split never
change a continuation's logits), in eval mode, without gradients, with every RNG stream
left untouched (E1). Each continuation's uniforms come from its own stream, addressed
by ``(seed, window, example, sample)``; a token is drawn by inverse CDF in float64 over
token ids, so a continuation is a function of its address and the logits alone.
``sample_window`` draws the same continuations for a whole window of prompts in
batches of ``generation.batch_rows`` left-padded rows with one key-value cache
(finished rows dropped); a draw can differ from ``sample_group``'s only where the
logits' fp32 rounding moves ``u * total`` across a CDF boundary (``near_tie``).
Design and derivations: docs/design/generation.md#generationsamplerpy (Q1, E1, S5).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from exactstep.generation.config import GenerationConfig
from exactstep.rows.batch import Batch, SourceSide, single_segment_batch, source_rows
from exactstep.state.rng import isolated

RNG_TAG = 0x51  # the rollout stream (distinct from other addressed draws)
DRAW_ELEMENTS = 1 << 20  # a vectorised draw's rows x V at once (float64 temporaries, 8 MiB)


@dataclass(frozen=True)
class Continuation:
    """One sampled continuation: ``tokens`` drawn after the prompt (its stop token
    included, when it drew one); ``logprobs[i]``: ``log p(tokens[i])`` under the
    model's own distribution (temperature 1, untruncated), float64; ``stopped``:
    whether it ended at a stop token (else at ``max_new_tokens``); ``entropies[i]``:
    the entropy of the model's own distribution the token was drawn at (float64, from
    the same logits; empty when not recorded)."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stopped: bool
    entropies: tuple[float, ...] = ()


def uniforms(seed: int, window: int, example_id: int, sample: int, n: int) -> np.ndarray:
    """The ``n`` uniforms ``[0, 1)`` of continuation ``(seed, window, example, sample)``."""
    return np.random.default_rng([seed, RNG_TAG, window, example_id, sample]).random(n)


def policy_probs(logits: np.ndarray, cfg: GenerationConfig) -> np.ndarray:
    """The sampling distribution over token ids (float64, sums to 1): softmax of
    ``logits / temperature`` restricted to the ``top_k`` likeliest ids and then to the
    smallest likeliest set reaching ``top_p``, renormalised. Ties in likelihood are
    broken by the lower id, so the kept set is a function of the logits alone."""
    z = logits.astype(np.float64) / cfg.temperature
    order = np.lexsort((np.arange(z.size), -z))  # likeliest first, lower id on ties
    keep = np.zeros(z.size, dtype=bool)
    kept = order[: cfg.top_k] if cfg.top_k else order
    keep[kept] = True
    p = np.where(keep, np.exp(z - z[order[0]]), 0.0)
    p /= p.sum()
    if cfg.top_p < 1.0:
        mass = np.cumsum(p[kept])
        cut = int(np.searchsorted(mass, cfg.top_p * mass[-1])) + 1  # reach p, no further
        keep[:] = False
        keep[kept[:cut]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def draw(logits: np.ndarray, u: float, cfg: GenerationConfig) -> tuple[int, float]:
    """One token from ``logits`` ``[V]`` and uniform ``u``, and its ``log p`` under the
    model's own distribution (float64): the argmax when greedy (the lower id on ties),
    else the inverse CDF of ``policy_probs`` over ids in order. Untruncated at
    temperature 1 the policy is the model's softmax itself, computed once for both."""
    token, logp, _ = draw_with_entropy(logits, u, cfg)
    return token, logp


def draw_with_entropy(logits: np.ndarray, u: float, cfg: GenerationConfig
                      ) -> tuple[int, float, float]:
    """``draw``'s token and ``log p``, and the entropy ``-sum_v p_v log p_v`` of the
    model's own distribution at this position (``log p = z - logsumexp(z)``, float64),
    from the same exponentials: one more product and sum over the vocabulary, no
    second softmax."""
    z = logits.astype(np.float64)
    shifted = z - z.max()
    weights = np.exp(shifted)
    total = weights.sum()
    log_total = np.log(total)
    if cfg.greedy:
        token = int(np.argmax(z))
    else:
        cdf = np.cumsum(weights if cfg.untruncated else policy_probs(logits, cfg))
        token = int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), z.size - 1))
    entropy = float(log_total - np.dot(weights, shifted) / total)
    return token, float(shifted[token] - log_total), entropy


def draw_rows(logits: np.ndarray, us: np.ndarray, cfg: GenerationConfig
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``draw_with_entropy`` for each row of ``logits`` ``[B, V]`` with its uniform
    ``us[b]``: the tokens ``[B]``, their ``log p`` ``[B]`` and the entropies ``[B]`` of
    the model's own distribution (float64), the same operations row by row (vectorised
    over rows when greedy or untruncated, a loop otherwise)."""
    if not (cfg.greedy or cfg.untruncated):
        triples = [draw_with_entropy(row, float(u), cfg)
                   for row, u in zip(logits, us, strict=True)]
        return (np.array([t for t, _, _ in triples], dtype=np.int64),
                np.array([lp for _, lp, _ in triples], dtype=np.float64),
                np.array([h for _, _, h in triples], dtype=np.float64))
    block = max(1, DRAW_ELEMENTS // logits.shape[1])
    if logits.shape[0] > block:  # bounded float64 temporaries: [block, V] each
        parts = [draw_rows(logits[i:i + block], us[i:i + block], cfg)
                 for i in range(0, logits.shape[0], block)]
        return tuple(np.concatenate([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]
    z = logits.astype(np.float64)
    shifted = z - z.max(axis=1, keepdims=True)
    weights = np.exp(shifted)
    total = weights.sum(axis=1)
    log_total = np.log(total)
    if cfg.greedy:
        tokens = np.argmax(z, axis=1)
    else:  # searchsorted(side="right") row by row: the count of CDF entries <= u * total
        cdf = np.cumsum(weights, axis=1)
        tokens = np.minimum((cdf <= (us * cdf[:, -1])[:, None]).sum(axis=1), z.shape[1] - 1)
    rows = np.arange(z.shape[0])
    entropies = np.array([log_total[b] - np.dot(weights[b], shifted[b]) / total[b]
                          for b in rows], dtype=np.float64)  # draw_with_entropy's, per row
    return tokens.astype(np.int64), shifted[rows, tokens] - log_total, entropies


def near_tie(logits: np.ndarray, u: float, slack: float) -> bool:
    """Whether the inverse-CDF draw from ``logits`` ``[V]`` (untruncated, temperature
    1) with uniform ``u`` could draw another token were each logit moved by at most
    ``slack`` (the sup norm of the perturbation). Each ratio ``r_j = C_j / S`` (the CDF
    at ``j`` over the total) moves by a factor within ``exp(+-2 slack)`` (numerator
    and denominator each by ``exp(+-slack)``), and float64's summation of ``V`` terms
    by a relative ``V eps`` in each computation; the drawn ``t`` (``r_{t-1} <= u <
    r_t``) is kept unless ``u`` lies within that of ``r_{t-1}`` or ``r_t``.
    Derivation: docs/design/generation.md#batched-sampling (Q1)."""
    z = logits.astype(np.float64)
    w = np.exp(z - z.max())
    cdf = np.cumsum(w) / w.sum()
    t = int(min(np.searchsorted(cdf, u, side="right"), z.size - 1))
    margin = math.expm1(2.0 * slack) + 2.0 * z.size * float(np.finfo(np.float64).eps)
    below = float(cdf[t - 1]) if t > 0 else 0.0
    return bool(u < below * (1.0 + margin) or (t < z.size - 1 and u >= cdf[t] * (1.0 - margin)))


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    """``log softmax`` of fp32 ``logits`` in float64."""
    z = logits.astype(np.float64)
    shifted = z - z.max()
    return shifted - np.log(np.exp(shifted).sum())


@torch.no_grad()
def sample_group(
    model: torch.nn.Module,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    seed: int,
    window: int,
    example_id: int,
    stop_ids: Sequence[int],
    device: torch.device | str = "cpu",
    samples: int | None = None,
    on_token: Callable[[int, int], None] | None = None,
    source: Sequence[int] | None = None,
    source_pad_id: int = 0,
) -> list[Continuation]:
    """``samples`` (default ``cfg.samples``) continuations of ``prompt``, the ``k``-th
    drawn with the uniforms of ``(seed, window, example_id, k)``.

    The model must return hidden states ``[B, T, H]`` for a ``Batch`` and logits from
    ``model.logits(hidden)``. A model with ``decode_step`` (the built-in decoder and
    encoder-decoder; the latter encodes the source once) keeps its keys and values and
    runs one new column per step; any other runs the ``K`` rows
    as one batch of whole rows each step (causal attention). Either way in eval mode with every RNG stream restored after
    (E1). A continuation stops at the first id in ``stop_ids`` or after
    ``cfg.max_new_tokens``. ``on_token(sample, token)`` is called as each token is drawn
    (streaming). ``source``: the encoder side of an encoder-decoder (every row the
    same source; ``prompt`` is then the decoder's start, ``BOS``).
    """
    k_rows = cfg.samples if samples is None else samples
    if not prompt:
        raise ValueError("sample_group needs a non-empty prompt")
    draws = [uniforms(seed, window, example_id, k, cfg.max_new_tokens) for k in range(k_rows)]
    stops = set(int(s) for s in stop_ids)
    filler = int(next(iter(stop_ids))) if stop_ids else 0
    tokens = torch.tensor([list(prompt)] * k_rows, dtype=torch.int64, device=device)  # [K, L]
    drawn: list[list[int]] = [[] for _ in range(k_rows)]
    logps: list[list[float]] = [[] for _ in range(k_rows)]
    ents: list[list[float]] = [[] for _ in range(k_rows)]
    done = [False] * k_rows
    inner = getattr(model, "module", model)
    cached = callable(getattr(inner, "decode_step", None))
    side = None if source is None else \
        source_rows([list(source)] * k_rows, source_pad_id).map(lambda t: t.to(device))
    cache = None
    with isolated(model):
        for step in range(cfg.max_new_tokens):
            if cached:  # the built-in models: keys and values kept, one new column a step
                new = tokens if cache is None else tokens[:, -1:]
                hidden, cache = (inner.decode_step(new, cache) if side is None else
                                 inner.decode_step(new, cache, source=side))
            else:
                hidden = model(prompt_batch(tokens, source, source_pad_id))  # [K, L', H]
            logits = inner.logits(hidden[:, -1:, :])[:, -1, :].float().cpu().numpy()  # [K, V]
            column = []
            for k in range(k_rows):
                if done[k]:
                    column.append(filler)
                    continue
                token, logp, entropy = draw_with_entropy(logits[k], float(draws[k][step]),
                                                         cfg)
                drawn[k].append(token)
                logps[k].append(logp)
                ents[k].append(entropy)
                done[k] = token in stops
                column.append(token)
                if on_token is not None:
                    on_token(k, token)
            if all(done):
                break
            tokens = torch.cat([tokens, torch.tensor(column, device=device)[:, None]], dim=1)
    return [Continuation(tuple(d), tuple(lp), bool(d) and d[-1] in stops, tuple(e))
            for d, lp, e in zip(drawn, logps, ents, strict=True)]


def prompt_batch(tokens: torch.Tensor, source: Sequence[int] | None, source_pad_id: int
                 ) -> Batch:
    """``tokens`` ``[K, L]`` as one causal segment per row; with ``source``, each row's
    encoder side is that source (one segment, paired with the row's decoder segment)."""
    batch = single_segment_batch(tokens)
    if source is None:
        return batch
    side = source_rows([list(source)] * tokens.shape[0], source_pad_id)
    return replace(batch, source=side.map(lambda t: t.to(tokens.device)))


@dataclass(frozen=True)
class SampleRequest:
    """One prompt of a window to continue: its ``example_id`` (the draws' address),
    its ``prompt`` ids (non-empty) and, for an encoder-decoder, its ``source``."""

    example_id: int
    prompt: tuple[int, ...]
    source: tuple[int, ...] | None = None


@torch.no_grad()
def sample_window(
    model: torch.nn.Module,
    requests: Sequence[SampleRequest],
    cfg: GenerationConfig,
    *,
    seed: int,
    window: int,
    stop_ids: Sequence[int],
    device: torch.device | str = "cpu",
    samples: int | None = None,
    source_pad_id: int = 0,
) -> list[list[Continuation]]:
    """For each request, ``samples`` (default ``cfg.samples``) continuations, the
    ``k``-th of request ``r`` drawn with the uniforms of ``(seed, window,
    r.example_id, k)``: what ``sample_group`` draws for each request alone, within
    the rounding of batch composition (``near_tie``).

    Every ``(request, sample)`` row of the window runs in batches of at most
    ``cfg.batch_rows`` rows (in request order), each with one key-value cache through
    the model's ``decode_step`` (the built-in decoder, the encoder-decoder, and every
    HF causal LM through ``past_key_values``): prompts of different lengths
    left-padded, each row's positions from 0 at its first real token, no query seeing
    a padding key; sources right-padded, each row's queries seeing its own source
    only. A row leaves the batch (and its cache) at its stop token. A model without
    ``decode_step``, or ``cfg.batch_rows = 0``, is sampled one request at a time by
    ``sample_group``. Eval mode,
    no gradients, every RNG stream restored after (E1).
    """
    k_rows = cfg.samples if samples is None else samples
    if any(not r.prompt for r in requests):
        raise ValueError("sample_window needs non-empty prompts")
    inner = getattr(model, "module", model)
    out: list[list[Continuation | None]] = [[None] * k_rows for _ in requests]
    if not callable(getattr(inner, "decode_step", None)) or cfg.batch_rows == 0:
        return [sample_group(model, r.prompt, cfg, seed=seed, window=window,
                             example_id=r.example_id, stop_ids=stop_ids, device=device,
                             samples=k_rows, source=r.source, source_pad_id=source_pad_id)
                for r in requests]
    rows = [(i, k) for i in range(len(requests)) for k in range(k_rows)]
    stops = frozenset(int(s) for s in stop_ids)
    with isolated(model):
        for lo in range(0, len(rows), cfg.batch_rows):
            part = rows[lo:lo + cfg.batch_rows]
            conts = sample_rows(
                inner, [requests[i] for i, _ in part],
                np.stack([uniforms(seed, window, requests[i].example_id, k, cfg.max_new_tokens)
                          for i, k in part]), cfg, stops, torch.device(device), source_pad_id)
            for (i, k), c in zip(part, conts, strict=True):
                out[i][k] = c
    return out  # type: ignore[return-value]


def padded_prompts(prompts: Sequence[Sequence[int]], filler: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` left-padded to the longest: ``(ids, positions, keys)`` ``[B, L]``,
    ``keys`` true at real tokens and each row's positions ``0 .. len - 1`` at them
    (0 at its padding, which no real query sees)."""
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)[:, None]
    ids = torch.full((len(prompts), width), filler, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.as_tensor(list(p), dtype=torch.int64)
    columns = torch.arange(width, dtype=torch.int64)[None, :]
    return ids, (columns - pad).clamp(min=0), columns >= pad


def select_rows(cache: object, index: torch.Tensor) -> object:
    """The cache of the rows ``index`` (dimension 0 of every tensor it holds; an HF
    ``Cache`` through its ``reorder_cache``)."""
    if cache is None:
        return None
    if callable(getattr(cache, "reorder_cache", None)):
        cache.reorder_cache(index)
        return cache
    if isinstance(cache, torch.Tensor):
        return cache.index_select(0, index.to(cache.device))
    if isinstance(cache, dict):
        return {key: select_rows(value, index) for key, value in cache.items()}
    if isinstance(cache, (list, tuple)):
        return type(cache)(select_rows(value, index) for value in cache)
    raise TypeError(f"cannot select rows of a cache holding {type(cache).__name__}")


def sample_rows(inner: torch.nn.Module, requests: Sequence[SampleRequest], draws: np.ndarray,
                cfg: GenerationConfig, stops: frozenset[int], device: torch.device,
                source_pad_id: int) -> list[Continuation]:
    """One batch of ``sample_window``: row ``b`` continues ``requests[b]`` with the
    uniforms ``draws[b]``, through ``inner.decode_step``."""
    B = len(requests)
    ids, positions, keys = (t.to(device) for t in padded_prompts([r.prompt for r in requests],
                                                                  0))  # 0: a valid id
    lengths = torch.tensor([len(r.prompt) for r in requests], dtype=torch.int64, device=device)
    extra = {}
    if requests[0].source is not None:
        side: SourceSide = source_rows([list(r.source or ()) for r in requests], source_pad_id)
        extra["source"] = side.map(lambda t: t.to(device))
    drawn: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    ents: list[list[float]] = [[] for _ in range(B)]
    stopped = [False] * B
    active = np.arange(B)  # the rows still in the batch, in batch order
    new, cache = ids, None
    for step in range(cfg.max_new_tokens):
        padded = not bool(keys.all())
        hidden, cache = inner.decode_step(new, cache, positions=positions,
                                          keys=keys if padded else None, **extra)
        extra = {}
        logits = inner.logits(hidden[:, -1:, :])[:, -1, :].float().cpu().numpy()  # [B', V]
        tokens, lps, hs = draw_rows(logits, draws[active, step], cfg)
        keep = []
        for j, b in enumerate(active):
            token = int(tokens[j])
            drawn[b].append(token)
            logps[b].append(float(lps[j]))
            ents[b].append(float(hs[j]))
            stopped[b] = token in stops
            if not stopped[b]:
                keep.append(j)
        if not keep or step + 1 == cfg.max_new_tokens:
            break
        if len(keep) < len(active):  # finished rows leave the batch and the cache
            index = torch.tensor(keep, dtype=torch.int64, device=device)
            cache = select_rows(cache, index)
            keys, lengths = keys.index_select(0, index), lengths.index_select(0, index)
            tokens, active = tokens[keep], active[keep]
        new = torch.as_tensor(tokens, dtype=torch.int64, device=device)[:, None]
        positions = (lengths + step)[:, None]
        keys = torch.cat([keys, torch.ones_like(keys[:, :1])], dim=1)
    return [Continuation(tuple(d), tuple(lp), s, tuple(e)) for d, lp, s, e in
            zip(drawn, logps, stopped, ents, strict=True)]
