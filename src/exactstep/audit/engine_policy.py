"""The ``exactstep-policy`` target: exactstep's policy family behind ``PolicyStep`` (Q3, Q4).

The production path: the family's rollout program (``families.policy.rollouts.
PolicyRollouts``: advantages, baselines, per-token coefficients, trajectory rows),
its plan (``objective.policy.policy_plan``: one S / D over the window and every rank),
the window transaction ``UpdateEngine.run_window`` and, under a process group, one
rank of a DDP job. The adapter only hands the probe's completions out as the
sampler's draws and its rewards as the reward function's, and keeps the gradient the
optimizer would apply. The engine keeps a prompt's K samples in one micro-batch, so
micro-batches smaller than K are not applicable. Variants
``exactstep-policy[:BASELINE[:NORMALIZER]]`` set ``policy.baseline`` and
``policy.normalizer`` (``sequence_mean`` fails ``policy_split``, as declared).
Design and derivations: docs/design/audit.md#auditpolicy_probespy (Q3, Q4).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from exactstep.audit.policy_probes import K, PolicyWindow
from exactstep.audit.probes import NotApplicable
from exactstep.audit.protocol import ProbeSpec
from exactstep.families.policy.config import PolicyConfig
from exactstep.families.policy.rewards import load_reward
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.generation.config import GenerationConfig
from exactstep.generation.sampler import Continuation
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.policy import policy_plan
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.process_group import DistContext
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.rows.example import Example
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

DEVICE = torch.device("cpu")
BASELINES = ("leave_one_out", "group_mean_with_self", "group_normalized")
NORMALIZERS = ("token_mean", "sequence_mean", "constant")


class FixedRollouts(PolicyRollouts):
    """The family's program with the probe's completions as the sampler's draws and
    the probe's rewards as the reward function's values."""

    window: PolicyWindow

    def rollouts(self, model, flat, window, device, samples):  # noqa: ANN001, ANN201
        return [[Continuation(tuple(c), (0.0,) * len(c), False)
                 for c in self.window.completions[r.example_id][:samples]] for r in flat]

    def score_window(self, flat, conts, window, K):  # noqa: ANN001, ANN201
        self._components = {}
        return np.array([[float(self.window.rewards[r.example_id][k]) for k in range(K)]
                         for r in flat], dtype=np.float64)


class ExactstepPolicyStep:
    """``PolicyStep`` over the policy family's program and ``UpdateEngine``."""

    ranks = 2

    def __init__(self, baseline: str = "leave_one_out",
                 normalizer: str = "token_mean") -> None:
        from exactstep.errors import ConfigError

        if baseline not in BASELINES:
            raise ConfigError(f"unknown exactstep-policy baseline {baseline!r}; use one of "
                              f"{', '.join(BASELINES)}")
        if normalizer not in NORMALIZERS:
            raise ConfigError(f"unknown exactstep-policy normalizer {normalizer!r}; use one "
                              f"of {', '.join(NORMALIZERS)}")
        self.baseline, self.normalizer = baseline, normalizer

    def build(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.module = build_model(ModelConfig(d_model=spec.d_model, n_layers=spec.n_layers,
                                              n_heads=spec.n_heads, d_ff=2 * spec.d_model,
                                              attention="segments"),
                                  spec.vocab_size, seed=spec.seed)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        batch = Batch(input_ids=tokens, labels=torch.full_like(tokens, IGNORE_INDEX),
                      position_ids=torch.arange(n).expand_as(tokens),
                      segment_ids=torch.ones_like(tokens, dtype=torch.int32),
                      segments=tuple((Segment(example_id=0, piece=0, offset=0, start=0,
                                              length=n),) for _ in range(len(tokens))))
        return self.module.logits(self.module(batch))

    def gradient(self, window: PolicyWindow, micro_batch: int,
                 ranks: int = 1) -> dict[str, torch.Tensor]:
        if micro_batch % K:
            raise NotApplicable(f"the engine keeps a prompt's {K} samples in one "
                                f"micro-batch; {micro_batch} is not a multiple")
        update_cfg = UpdateConfig(accum=1, optimizer="sgd", lr=self.spec.lr,
                                  schedule="constant", clip=0.0, weight_decay=0.0,
                                  momentum=0.0)
        optimizer, _ = build_optimizer(self.module, update_cfg)
        policy = PolicyConfig(over="chat", baseline=self.baseline,
                              normalizer=self.normalizer)
        longest = max(len(c) for g in window.completions for c in g)
        program = FixedRollouts(
            policy, GenerationConfig(samples=K, max_new_tokens=longest), seed=self.spec.seed,
            seq_len=64, examples=[prompt_example(g, p, self.spec) for g, p in
                                  enumerate(window.prompts)],
            reward=load_reward("exact_match", 4), stop_ids=(self.spec.eos_id,),
            decode=lambda ids: " ".join(map(str, ids)))
        program.window = window
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        mine = [g for g in range(len(window.prompts)) if g * world // len(window.prompts) == rank]
        per = micro_batch // K
        batches = [placeholder(mine[i:i + per]) for i in range(0, len(mine), per)]
        update_cfg = replace(update_cfg, accum=len(batches))
        engine = UpdateEngine(self.module, optimizer, build_schedule(update_cfg, 1),
                              Precision(NumericsConfig(precision="fp32"), DEVICE), update_cfg,
                              ObjectiveConfig(), device=DEVICE, pad_id=self.spec.pad_id,
                              plan=policy_plan(policy.normalizer, policy.constant, rank=rank),
                              program=program)
        if world > 1:
            distribute_engine(engine, DistContext(rank=rank, world_size=world,
                                                  local_rank=rank, device=DEVICE,
                                                  backend="gloo"), ParallelConfig())
        captured: dict[str, torch.Tensor] = {}
        names = {id(p): n for n, p in self.module.named_parameters()}
        step = optimizer.step

        def capture(*args: object, **kwargs: object) -> object:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    captured[names[id(p)]] = p.grad.detach().clone()
            return step(*args, **kwargs)

        optimizer.step = capture
        self.module.train()
        engine.run_window(batches, 0)
        return captured


def placeholder(groups: list[int]) -> Batch:
    """A micro-batch that names its examples (the program reads only the segments)."""
    ids = torch.zeros((len(groups), 1), dtype=torch.int64)
    return Batch(input_ids=ids, labels=torch.full_like(ids, IGNORE_INDEX),
                 position_ids=ids.clone(), segment_ids=torch.ones((len(groups), 1),
                                                                  dtype=torch.int32),
                 segments=tuple((Segment(example_id=g, piece=0, offset=0, start=0, length=1),)
                                for g in groups))


def prompt_example(group: int, prompt: tuple[int, ...], spec: ProbeSpec) -> Example:
    """The prompt as a chat example: its tokens unowned, then one owned reference token
    (the program samples in place of the reference)."""
    return Example(example_id=group, tokens=np.array(prompt + (spec.eos_id,), dtype=np.int64),
                   owned=np.array([False] * len(prompt) + [True]))


def make(variant: str = "") -> ExactstepPolicyStep:
    """``exactstep-policy[:BASELINE[:NORMALIZER]]``."""
    parts = [p for p in variant.split(":")] if variant else []
    if len(parts) > 2:
        from exactstep.errors import ConfigError

        raise ConfigError(f"exactstep-policy variant {variant!r} reads "
                          "BASELINE[:NORMALIZER]")
    defaults = ("leave_one_out", "token_mean")[:len(parts)]
    return ExactstepPolicyStep(*[p or d for p, d in zip(parts, defaults, strict=True)])
