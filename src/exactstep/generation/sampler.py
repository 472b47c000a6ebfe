"""The sampler: a prompt's continuations drawn from the model with addressed draws (Q1).

``sample_group`` continues one prompt ``K`` times in one batch of ``K`` equal rows
(never beside another prompt's rows, so a window's packing and micro-batch split never
change a continuation's logits), in eval mode, without gradients, with every RNG stream
left untouched (E1). Each continuation's uniforms come from its own stream, addressed
by ``(seed, window, example, sample)``; a token is drawn by inverse CDF in float64 over
token ids, so a continuation is a function of its address and the logits alone.
Design and derivations: docs/design/generation.md#generationsamplerpy (Q1, E1, S5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from exactstep.generation.config import GenerationConfig
from exactstep.rows.batch import Batch, single_segment_batch, source_rows
from exactstep.state.rng import isolated

RNG_TAG = 0x51  # the rollout stream (distinct from other addressed draws)


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
