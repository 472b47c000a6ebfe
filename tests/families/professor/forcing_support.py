"""What the Professor Forcing tests share: a tiny chat-shaped training split, windows of
prompt batches that name its examples, and an engine running the family's window
program (``families.professor.forcing``) with the family's plan, plain SGD on both models."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from run_support import TINY_MODEL
from torch.func import functional_call

from exactstep.families.professor import reference
from exactstep.families.professor.config import ProfessorConfig
from exactstep.families.professor.forcing import ProfessorForcing
from exactstep.generation.config import GenerationConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.professor import professor_plan
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment, single_segment_batch
from exactstep.rows.example import Example
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

V, EOS, SEP = 24, 2, 3
G_LR, D_LR = 0.2, 0.5
GENERATION = GenerationConfig(max_new_tokens=6)


def split(n: int = 6, seed: int = 0) -> list[Example]:
    """Chats ``BOS q.. SEP r.. EOS``: a 2-4 token question, a 2-5 token answer (the
    owned reference, its EOS included)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        q = rng.integers(4, V, size=int(rng.integers(2, 5))).tolist()
        r = rng.integers(4, V, size=int(rng.integers(2, 6))).tolist()
        tokens = np.array([1, *q, SEP, *r, EOS], dtype=np.int64)
        owned = np.zeros(len(tokens), dtype=bool)
        owned[len(q) + 2:] = True
        out.append(Example(i, tokens, owned))
    return out


def prompts(ids: Sequence[int]) -> Batch:
    """A micro-batch of prompts naming examples ``ids`` (one row each): the program reads
    only the rows' addresses."""
    n = len(ids)
    empty = torch.zeros((n, 1), dtype=torch.int64)
    return Batch(input_ids=empty, labels=torch.full_like(empty, IGNORE_INDEX),
                 position_ids=empty.clone(), segment_ids=torch.ones((n, 1), dtype=torch.int32),
                 segments=tuple((Segment(i, 0, 0, 0, 1),) for i in ids))


def professor(**kw) -> ProfessorConfig:
    base = dict(over="chat", d_optimizer="sgd", d_lr=D_LR, d_clip=0.0, d_hidden=8,
                lambda_free=1.0, lambda_forced=0.5, d_steps=2)
    return ProfessorConfig(**{**base, **kw})


def generator_update(**kw) -> UpdateConfig:
    return UpdateConfig(**{**dict(optimizer="sgd", lr=G_LR, momentum=0.0, weight_decay=0.0,
                                  clip=0.0, schedule="constant", warmup=0), **kw})


class Setup:
    """A generator, the program (its discriminator) and the engine over them."""

    def __init__(self, cfg: ProfessorConfig, *, program_cls=ProfessorForcing, seed: int = 7,
                 examples: Sequence[Example] | None = None, update: UpdateConfig | None = None,
                 windows: int = 10, reducer=None) -> None:
        torch.manual_seed(0)
        self.cfg = cfg
        self.examples = list(examples if examples is not None else split())
        self.model = build_model(TINY_MODEL, V, seed=seed)
        self.program = program_cls(cfg, GENERATION, seed=seed, seq_len=32,
                                   examples=self.examples, stop_ids=(EOS,),
                                   width=TINY_MODEL.d_model, total_windows=windows)
        update = update or generator_update()
        optimizer, _ = build_optimizer(self.model, update)
        self.engine = UpdateEngine(self.model, optimizer, build_schedule(update, windows),
                                   Precision(NumericsConfig(precision="fp32"), "cpu"), update,
                                   ObjectiveConfig(), device="cpu", pad_id=0,
                                   plan=professor_plan(), program=self.program,
                                   reducer=reducer)
        self.free: dict[int, tuple[int, ...]] = {}
        rollouts = self.program.rollouts

        def recorded(model, requests, window, device):
            conts = rollouts(model, requests, window, device)
            for r, c in zip(requests, conts, strict=True):
                self.free[r.example_id] = c.tokens
            return conts

        self.program.rollouts = recorded

    def window(self, microbatches: Sequence[Sequence[int]], window: int = 0):
        return self.engine.run_window([prompts(ids) for ids in microbatches], window)

    def generator(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def discriminator(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in
                self.program.discriminator.named_parameters()}

    def paths(self, ids: Sequence[int]) -> list[reference.Paths]:
        """The examples' paths as the window drew them (after ``window``)."""
        out = []
        for i in ids:
            r = self.program.request(i)
            out.append(reference.Paths(r.prompt, r.reference, self.free[i]))
        return out


def reference_updates(setup: Setup, g: dict, d: dict, ids: Sequence[int], dtype: torch.dtype,
                      cfg: ProfessorConfig | None = None) -> tuple[dict, dict]:
    """The reference's parameters after the window, computed in ``dtype`` from ``g``,
    ``d`` (the window's starting parameters) and the paths the window drew."""
    model = copy.deepcopy(setup.model).to(dtype)

    def hidden(params, tokens):
        batch = single_segment_batch(torch.tensor([list(tokens)], dtype=torch.int64))
        return functional_call(model, dict(params), (batch,))[0]

    def logits(params, h):
        return h @ params["embed.weight"].T  # the tied head

    cast = {k: v.to(dtype) for k, v in g.items()}
    return reference.window_updates(cast, {k: v.to(dtype) for k, v in d.items()},
                                    setup.paths(ids), cfg or setup.cfg, g_lr=G_LR, d_lr=D_LR,
                                    hidden=hidden, logits=logits)


def with_order(cfg: ProfessorConfig, order: str) -> ProfessorConfig:
    return replace(cfg, order=order, d_steps=cfg.d_steps if order == "d_then_g" else 1)
