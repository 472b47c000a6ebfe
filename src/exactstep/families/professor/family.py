"""Professor Forcing over a base family (Q5, R8): the base's data, compiler, model and
score; the two-path window program with its discriminator (``forcing.py``) and
the generator's plan (``objective.professor``) in the stages that run them; a manifest
naming every part the procedure has (paths, behaviour, discriminator, coefficients,
order, optimizers, rollout policy).
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.families.encdec.compiler import source_pad_of
from exactstep.families.professor.config import DECODER_BASES
from exactstep.families.professor.forcing import ProfessorForcing
from exactstep.families.registry import Family, family_of
from exactstep.objective.professor import professor_plan


def check(cfg: RunConfig) -> None:
    """The refusals a Professor Forcing run meets before anything is written (X4)."""
    gen = cfg.generation
    check_base(cfg)
    if gen.max_new_tokens >= cfg.batch.seq_len:
        raise ConfigError(
            f"professor: a free run of generation.max_new_tokens = {gen.max_new_tokens} "
            f"tokens after its prompt cannot fit a row of batch.seq_len = "
            f"{cfg.batch.seq_len}; lower generation.max_new_tokens or raise batch.seq_len")
    if cfg.objective.reduction != "token_mean":
        raise ConfigError(
            "objective.family = 'professor' normalizes by the window's examples "
            f"(professor.nll); leave objective.reduction at token_mean (got "
            f"{cfg.objective.reduction!r})")
    if cfg.parallel.strategy == "fsdp":
        raise ConfigError("objective.family = 'professor' samples with each rank's whole "
                          "model: use parallel.strategy = 'ddp'")


def family(cfg: RunConfig) -> Family:
    check_base(cfg)
    base = family_of(replace(cfg, objective=replace(cfg.objective, family=cfg.professor.over)))

    def objective(cfg: RunConfig) -> dict[str, Any]:
        check(cfg)
        inner = base.objective(cfg)
        return {**inner, "family": f"professor_{inner['family']}",
                "ownership": "teacher_forced_reference_tokens",
                "estimator": "Professor Forcing: teacher-forced likelihood plus an adversarial "
                             "cost on the free-running behaviour (not maximum likelihood "
                             "alone)",
                "professor": cfg.professor.describe(),
                "generation": {**asdict(cfg.generation), "samples": 1,
                               "samples_note": "one free run per example; "
                                               "generation.samples is not read"}}

    def program(cfg: RunConfig, parts: Any, model: Any, device: Any) -> ProfessorForcing:
        check(cfg)
        tokenizer = parts.tokenizer
        return ProfessorForcing(
            cfg.professor, cfg.generation, seed=cfg.seed, seq_len=cfg.batch.seq_len,
            examples=parts.data.train, stop_ids=(tokenizer.eos_id,),
            width=width_of(model if model is not None else
                           base.build_model(cfg, tokenizer.vocab_size)),
            total_windows=cfg.train.steps,
            device=device,
            source_pad_id=(source_pad_of(cfg.encdec, tokenizer)
                           if cfg.professor.over == "encdec" else 0))

    return replace(base, name="professor", objective=objective, program=program,
                   plan=lambda cfg, rank: professor_plan(rank=rank))


def width_of(model: Any) -> int:
    """The generator's hidden size: the behaviour's width."""
    return int(model.head_weight.shape[-1])


def check_base(cfg: RunConfig) -> None:
    """The base must have a decoder that can run free, before it is even opened."""
    if cfg.professor.over not in DECODER_BASES:
        raise ConfigError(
            f"objective.family = 'professor' runs a decoder free; professor.over = "
            f"{cfg.professor.over!r} has no decoder that can continue a prompt: choose one "
            f"of {', '.join(DECODER_BASES)}")


FAMILY = family  # a function of the run's configuration: the family over its base
