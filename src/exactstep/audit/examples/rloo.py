"""An RLOO-style policy loop, correct, wrapped for ``exactstep audit`` (Q3, Q4).

Run it with ``exactstep audit --target python:exactstep.audit.examples.rloo:make``.
REINFORCE with the leave-one-out baseline (each sample's baseline is the mean of the
other K-1 rewards of its prompt) and one token mean over the window: the window's
sampled-token count is summed over every micro-batch and all-reduced over the ranks
before the first backward, each micro-batch's loss is its sum over that count, and
DDP's gradient average is undone by the world size. The model is the nanoGPT example's.
``make_variant(NAME)`` plants one of the bugs the policy probes look for
(``per_microbatch``, ``divided_twice``, ``group_mean``, ``group_normalized``,
``rank_mean``, ``per_sequence``: each sequence's token mean, then the mean over the
window's sequences, as trl's ``grpo``), for the audit's own tests.
Design and derivations: docs/design/audit.md#auditpolicy_probespy (Q3, Q4).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
from torch import nn

from exactstep.audit.examples.nanogpt import GPT
from exactstep.audit.policy_probes import PolicyWindow
from exactstep.audit.protocol import ProbeSpec

VARIANTS = ("correct", "per_microbatch", "divided_twice", "group_mean", "group_normalized",
            "rank_mean", "per_sequence")


class RLOOLoop:
    """``PolicyStep`` over a plain-PyTorch RLOO loop (``variant`` plants a bug)."""

    ranks = 2  # gradient() under a process group is one rank of a DDP job

    def __init__(self, variant: str = "correct") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; use one of {', '.join(VARIANTS)}")
        self.variant = variant

    def build(self, spec: ProbeSpec) -> None:
        torch.manual_seed(spec.seed)
        self.module = GPT(spec)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return self.module(tokens, positions, torch.zeros_like(tokens))

    def advantages(self, rewards: tuple[float, ...]) -> list[float]:
        if self.variant == "group_mean":
            mean = sum(rewards) / len(rewards)
            return [r - mean for r in rewards]
        if self.variant == "group_normalized":
            mean, spread = sum(rewards) / len(rewards), statistics.stdev(rewards)
            return [(r - mean) / (spread + 1e-4) for r in rewards]
        total = sum(rewards)
        return [r - (total - r) / (len(rewards) - 1) for r in rewards]

    def samples(self, window: PolicyWindow) -> list[tuple[list[int], int, float]]:
        """(prompt + completion, prompt length, advantage) of this rank's groups."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        out = []
        for g, (p, cs, rs) in enumerate(zip(window.prompts, window.completions,
                                            window.rewards, strict=True)):
            if g * world // len(window.prompts) != rank:
                continue
            out += [(list(p) + list(c), len(p), a)
                    for c, a in zip(cs, self.advantages(rs), strict=True)]
        return out

    def gradient(self, window: PolicyWindow, micro_batch: int,
                 ranks: int = 1) -> dict[str, torch.Tensor]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        model = nn.parallel.DistributedDataParallel(self.module) if world > 1 else self.module
        mine = self.samples(window)
        micro = [mine[i:i + micro_batch] for i in range(0, len(mine), micro_batch)]
        count = torch.tensor(float(sum(len(t) - n for t, n, _ in mine)))
        n_sequences = window.samples
        if world > 1 and self.variant != "rank_mean":
            dist.all_reduce(count)  # the window's tokens over every rank (Q4)
        self.module.zero_grad(set_to_none=True)
        for mb in micro:
            tokens = [t for t, _, _ in mb]
            width = max(len(t) for t in tokens)
            batch = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
            positions = torch.arange(width).expand_as(batch)
            logp = torch.log_softmax(model(batch, positions, torch.zeros_like(batch)), -1)
            total = torch.zeros(())
            for row, (t, n, a) in enumerate(mb):
                target = torch.tensor(t[n:])
                term = a * logp[row, n - 1:len(t) - 1].gather(1, target[:, None]).sum()
                if self.variant == "per_sequence":  # 1 / length, over the window's sequences
                    term = term / len(target) * count / n_sequences
                total = total - term
            tokens_here = sum(len(t) - n for t, n, _ in mb)
            if self.variant == "per_microbatch":
                loss = total / tokens_here / len(micro)
            elif self.variant == "divided_twice":
                loss = total / count / len(micro)
            else:
                loss = total / count
            if self.variant != "rank_mean":
                loss = loss * world  # DDP averages over ranks: undone, a sum over the window
            loss.backward()
        return {n: p.grad.detach().clone() for n, p in self.module.named_parameters()}


def make() -> RLOOLoop:
    return RLOOLoop()


def make_variant(variant: str) -> RLOOLoop:
    return RLOOLoop(variant)
