"""Sequence-level policy training over a base family (R8, Q1-Q4): the base's data,
compiler, model and score; the rollout program (``rollouts.py``) and the policy plan
(``objective.py``) in the update stage; a manifest naming the estimator, the reward's
identity, the sampling policy and the frozen reference.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.families.encdec.compiler import source_pad_of
from exactstep.families.policy.clipped import ClippedRollouts
from exactstep.families.policy.config import BIASED
from exactstep.families.policy.rewards import (
    Reward,
    Rewards,
    load_reward,
    load_rewards,
    sampled_text,
)
from exactstep.families.policy.rollouts import PolicyRollouts
from exactstep.families.registry import Family, family_of
from exactstep.model.lora import BaseWithoutAdapters
from exactstep.objective.policy import policy_plan
from exactstep.state.checkpointer import load_weights


def check(cfg: RunConfig) -> None:
    """The refusals a policy run meets before anything is written (X4)."""
    policy, gen = cfg.policy, cfg.generation
    if not gen.untruncated:
        raise ConfigError(
            "policy training samples from the model's own distribution (REINFORCE's "
            "gradient is of log pi): set generation.temperature = 1, generation.top_k = 0 "
            f"and generation.top_p = 1 (got {gen.temperature}, {gen.top_k}, {gen.top_p})")
    if gen.samples < 2 and policy.baseline in ("leave_one_out", *BIASED):
        raise ConfigError(
            f"policy.baseline = {policy.baseline!r} needs generation.samples >= 2 (a group "
            f"of samples per prompt); got {gen.samples}")
    if cfg.objective.reduction != "token_mean":
        raise ConfigError(
            "objective.family = 'policy' normalizes by policy.normalizer; leave "
            f"objective.reduction at token_mean (got {cfg.objective.reduction!r})")
    if cfg.objective.label_smoothing:
        raise ConfigError("objective.family = 'policy' trains -log pi of each scored token: "
                          "set objective.label_smoothing = 0")
    if cfg.parallel.strategy == "fsdp":
        raise ConfigError("objective.family = 'policy' samples with each rank's whole model: "
                          "use parallel.strategy = 'ddp' (FSDP's gathered forwards would "
                          "need every rank to sample in lockstep)")
    if policy.epochs > 1 and policy.mixer:
        raise ConfigError("policy.epochs > 1 trains sampled tokens by their clipped "
                          "importance ratio; MIXER's teacher-forced tokens have none and its "
                          "curriculum counts windows: set policy.mixer = false or "
                          "policy.epochs = 1")
    if policy.epochs > 1 and policy.kl in ("k3", "k3_corrected"):
        raise ConfigError(f"policy.kl = {policy.kl!r} is a gradient term at the rollout's "
                          "parameters, "
                          "stale after the window's first step: with policy.epochs > 1 use "
                          "policy.kl = 'k1' (in the reward) or policy.epochs = 1")
    lora = cfg.model.lora.enabled
    if policy.kl != "none" and not policy.reference and not lora:
        raise ConfigError(f"policy.kl = {policy.kl!r} needs policy.reference: the checkpoint "
                          "directory of the frozen reference policy (or, with model.lora, "
                          "\"base\": the frozen base without the adapters)")
    if policy.reference == BASE and not lora:
        raise ConfigError("policy.reference = \"base\" is the frozen base of a LoRA policy: "
                          "set model.lora (model.lora.r > 0), or give a checkpoint directory")


#: ``policy.reference`` naming a LoRA policy's own frozen base (the default with LoRA).
BASE = "base"


def base_reference(cfg: RunConfig) -> bool:
    """The reference is the LoRA policy's base with its adapters off (no second copy)."""
    return cfg.policy.kl != "none" and cfg.model.lora.enabled and \
        cfg.policy.reference in ("", BASE)


def declared_rewards(cfg: RunConfig) -> Reward | Rewards:
    """``policy.rewards`` (each per batch, weighted) or the one ``policy.reward``."""
    if cfg.policy.rewards:
        return load_rewards(cfg.policy.rewards, cfg.policy.ngram, cfg.data.columns,
                            conversational=cfg.policy.over == "chat")
    return load_reward(cfg.policy.reward, cfg.policy.ngram)


def reference_identity(path: str) -> dict[str, Any]:
    """The reference checkpoint's identity: its path and the SHA-256 of its manifest
    (which holds every file's digest, S3)."""
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        raise ConfigError(f"policy.reference {path!r} is not a checkpoint directory (no "
                          "manifest.json); give one of a run's checkpoints/ entries")
    return {"checkpoint": str(path),
            "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest()}


def family(cfg: RunConfig) -> Family:
    base = family_of(replace(cfg, objective=replace(cfg.objective, family=cfg.policy.over)))

    def objective(cfg: RunConfig) -> dict[str, Any]:
        check(cfg)
        out = {**base.objective(cfg), "family": f"policy_{base.objective(cfg)['family']}",
               "ownership": "sampled_and_teacher_forced_response_tokens",
               "estimator": "REINFORCE with a baseline (sequence-level policy training; "
                            "not teacher-forced maximum likelihood)",
               "policy": cfg.policy.describe(),
               "reward": declared_rewards(cfg).identity,
               "generation": asdict(cfg.generation)}
        if base_reference(cfg):
            out["reference"] = "base_without_adapters"
        elif cfg.policy.kl != "none":
            out["reference"] = reference_identity(cfg.policy.reference)
        if cfg.data.columns:
            out["columns"] = list(cfg.data.columns)
        return out

    def program(cfg: RunConfig, parts: Any, model: Any, device: Any) -> PolicyRollouts:
        check(cfg)
        reference = None
        if base_reference(cfg):  # the same weights, adapters disabled per call
            reference = BaseWithoutAdapters(model)
        elif cfg.policy.kl != "none":
            reference = load_reference(cfg, parts, device)
        tokenizer = parts.tokenizer
        rollouts = ClippedRollouts if cfg.policy.epochs > 1 else PolicyRollouts
        return rollouts(cfg.policy, cfg.generation, seed=cfg.seed,
                              seq_len=cfg.batch.seq_len, examples=parts.data.train,
                              reward=declared_rewards(cfg), columns=cfg.data.columns,
                              stop_ids=(tokenizer.eos_id,),
                              decode=sampled_text(tokenizer.decode, tokenizer.vocab_size),
                              reference=reference,
                              source_pad_id=(source_pad_of(cfg.encdec, tokenizer)
                                             if cfg.policy.over == "encdec" else 0))

    def load_reference(cfg: RunConfig, parts: Any, device: Any) -> torch.nn.Module:
        """The frozen reference policy: the base model with the checkpoint's weights, in
        eval mode, no parameter requiring gradients (never trainable state)."""
        reference_identity(cfg.policy.reference)
        model = base.build_model(cfg, parts.tokenizer.vocab_size)
        load_weights(Path(cfg.policy.reference), model)
        model = model.to(device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    return replace(base, name="policy", objective=objective, program=program,
                   updates_per_window=lambda cfg: cfg.policy.epochs,
                   plan=lambda cfg, rank: policy_plan(cfg.policy.normalizer,
                                                      cfg.policy.constant, rank=rank))


FAMILY = family  # a function of the run's configuration: the family over its base
