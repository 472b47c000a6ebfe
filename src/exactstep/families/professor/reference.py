"""A reference of one Professor Forcing window's two updates, from the definitions (Q5).

Each example is taken alone (no padding, no batching, no packing); the discriminator's
GRU is written out from its equations (PyTorch's gate layout, both directions); the
losses are summed in the dtype of the parameters given (float64 for the reference) and
both optimizers are plain SGD, so the updates are ``-lr * gradient``. The engine's
window (``families.professor.forcing`` under ``UpdateEngine``, padded and batched, with the packed
GRU) must agree with it to a derived tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from exactstep.families.professor.config import ProfessorConfig

Params = dict[str, torch.Tensor]
#: ``(generator parameters, tokens)`` -> final hidden states ``[len(tokens), H]`` of the
#: row ``tokens`` (column ``i`` has read ``tokens[: i + 1]``)
HiddenFn = Callable[[Mapping[str, torch.Tensor], Sequence[int]], torch.Tensor]
#: ``(generator parameters, hidden [L, H])`` -> logits ``[L, V]``
LogitsFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Paths:
    """One example's two paths: its prompt, reference response and free continuation."""

    prompt: tuple[int, ...]
    reference: tuple[int, ...]
    free: tuple[int, ...]


def gru_final(d: Mapping[str, torch.Tensor], xs: torch.Tensor, suffix: str = "") -> torch.Tensor:
    """The final state of one direction of ``nn.GRU`` (layer 0) over ``xs`` ``[L, in]``:
    ``r, z = sigmoid(W_i x + b_i + W_h h + b_h)``, ``n = tanh(W_in x + b_in + r (W_hn h +
    b_hn))``, ``h' = (1 - z) n + z h``, from ``h = 0``."""
    w_ih, w_hh = d[f"gru.weight_ih_l0{suffix}"], d[f"gru.weight_hh_l0{suffix}"]
    b_ih, b_hh = d[f"gru.bias_ih_l0{suffix}"], d[f"gru.bias_hh_l0{suffix}"]
    hidden = w_hh.shape[1]
    h = xs.new_zeros(hidden)
    for x in xs:
        gi = w_ih @ x + b_ih
        gh = w_hh @ h + b_hh
        r = torch.sigmoid(gi[:hidden] + gh[:hidden])
        z = torch.sigmoid(gi[hidden:2 * hidden] + gh[hidden:2 * hidden])
        n = torch.tanh(gi[2 * hidden:] + r * gh[2 * hidden:])
        h = (1 - z) * n + z * h
    return h


def logit(d: Mapping[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
    """The discriminator's logit of ``P(teacher-forced)`` for one behaviour ``[L, H]``."""
    x = seq @ d["project.weight"].T + d["project.bias"]
    both = torch.cat([gru_final(d, x), gru_final(d, x.flip(0), "_reverse")])
    hid = torch.relu(d["mlp.0.weight"] @ both + d["mlp.0.bias"])
    return (d["mlp.2.weight"] @ hid + d["mlp.2.bias"])[0]


def steps_of(p: Paths, cfg: ProfessorConfig) -> tuple[slice, slice]:
    """The compared columns of the teacher-forced and the free-running row."""
    first = len(p.prompt) - 1
    n_tf, n_free = len(p.reference), len(p.free)
    if cfg.compare == "common":
        n_tf = n_free = min(n_tf, n_free)
    return slice(first, first + n_tf), slice(first, first + n_free)


def row(p: Paths, response: tuple[int, ...]) -> tuple[int, ...]:
    return (p.prompt + response)[:-1]


def behaviours(g: Mapping[str, torch.Tensor], pairs: Sequence[Paths], cfg: ProfessorConfig,
               hidden: HiddenFn) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each example's ``(teacher-forced, free-running)`` behaviour under ``g``."""
    out = []
    for p in pairs:
        tf, fr = steps_of(p, cfg)
        out.append((hidden(g, row(p, p.reference))[tf], hidden(g, row(p, p.free))[fr]))
    return out


def discriminator_loss(d: Mapping[str, torch.Tensor],
                       pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``sum softplus(-z_tf) + softplus(z_free)`` over the examples, divided by their count."""
    total = sum(F.softplus(-logit(d, tf)) + F.softplus(logit(d, fr)) for tf, fr in pairs)
    return total / len(pairs)


def generator_loss(g: Mapping[str, torch.Tensor], d: Mapping[str, torch.Tensor],
                   pairs: Sequence[Paths], cfg: ProfessorConfig, hidden: HiddenFn,
                   logits: LogitsFn) -> torch.Tensor:
    """``(sum_tf-tokens a_t (-log p) + lambda_free softplus(-z_free) + lambda_forced
    softplus(z_tf)) / N`` with the discriminator ``d`` held fixed."""
    total = 0.0
    for p, (tf, fr) in zip(pairs, behaviours(g, pairs, cfg, hidden), strict=True):
        first = len(p.prompt) - 1
        h = hidden(g, row(p, p.reference))
        logp = torch.log_softmax(logits(g, h[first:first + len(p.reference)]), dim=-1)
        nll = -logp[torch.arange(len(p.reference)), torch.tensor(p.reference)]
        a = 1.0 if cfg.nll == "sequence_sum" else 1.0 / len(p.reference)
        total = total + a * nll.sum()
        if cfg.lambda_free:
            total = total + cfg.lambda_free * F.softplus(-logit(d, fr))
        if cfg.lambda_forced:
            total = total + cfg.lambda_forced * F.softplus(logit(d, tf))
    return total / len(pairs)


def window_updates(g: Params, d: Params, pairs: Sequence[Paths], cfg: ProfessorConfig, *,
                   g_lr: float, d_lr: float, hidden: HiddenFn, logits: LogitsFn,
                   ) -> tuple[Params, Params]:
    """The generator's and discriminator's parameters after one window (SGD both):
    ``d_steps`` discriminator steps on the behaviour at the window's generator, then
    the generator's step against the discriminator the order names."""
    with torch.no_grad():
        seen = behaviours(g, pairs, cfg, hidden)  # the generator at the window's start
    start = {k: v.detach() for k, v in d.items()}
    cur = dict(start)
    for _ in range(cfg.d_steps):
        leaves = {k: v.detach().requires_grad_(True) for k, v in cur.items()}
        grads = torch.autograd.grad(discriminator_loss(leaves, seen), list(leaves.values()))
        cur = {k: v.detach() - d_lr * gr for (k, v), gr in zip(leaves.items(), grads,
                                                                strict=True)}
    against = cur if cfg.order == "d_then_g" else start
    leaves = {k: v.detach().requires_grad_(True) for k, v in g.items()}
    loss = generator_loss(leaves, against, pairs, cfg, hidden, logits)
    names = [k for k, v in leaves.items() if v.dtype.is_floating_point]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    new_g = {k: v.detach() for k, v in g.items()}
    for k, gr in zip(names, grads, strict=True):
        if gr is not None:
            new_g[k] = g[k].detach() - g_lr * gr
    return new_g, cur
