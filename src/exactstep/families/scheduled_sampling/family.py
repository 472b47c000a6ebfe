"""Scheduled sampling over a base family (R8): the base's data, compiler, model and
score, with the input program (``inputs.py``) and a manifest that says
the estimator is no longer teacher-forced maximum likelihood.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from exactstep.config import RunConfig
from exactstep.families.registry import Family, family_of
from exactstep.families.scheduled_sampling.inputs import ScheduledSampling


def scheduled_inputs(cfg: RunConfig) -> Any:
    return ScheduledSampling(cfg.scheduled_sampling, seed=cfg.seed)


def family(cfg: RunConfig) -> Family:
    """Scheduled sampling over its base family (``scheduled_sampling.over``: the causal
    decoder on text, or the encoder-decoder on pairs): the base's data, compiler, model
    and score, with the input program and the manifest saying the estimator changed."""
    base = family_of(replace(cfg, objective=replace(cfg.objective,
                                                    family=cfg.scheduled_sampling.over)))

    def objective(cfg: RunConfig) -> dict[str, Any]:
        family = base.objective(cfg)["family"]
        return {**base.objective(cfg), "family": f"scheduled_sampling_{family}",
                "estimator": "scheduled_sampling (not teacher-forced maximum likelihood)",
                "inputs": cfg.scheduled_sampling.describe()}

    return replace(base, name="scheduled_sampling", objective=objective,
                   inputs=scheduled_inputs)


FAMILY = family  # a function of the run's configuration: the family over its base
