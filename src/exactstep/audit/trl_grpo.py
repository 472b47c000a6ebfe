"""The ``trl-grpo`` target: ``trl``'s ``GRPOTrainer`` behind ``PolicyStep`` (Q3, Q4).

The stock trainer on a tiny ``LlamaForCausalLM`` (the ``hf-trainer`` target's model).
The probe's window enters through trl's own ``rollout_func`` hook: each prompt's K
completions are handed out as generated, and a reward function returns each
completion's given reward, so trl's advantages, loss, normaliser, accumulation and
distributed reduction all run as shipped. ``gradient`` trains one optimizer step and
keeps the gradient an ``on_pre_optimizer_step`` callback sees (clipping off).
Variants ``trl-grpo[:LOSS_TYPE[:SCALE_REWARDS]]``: trl's ``loss_type`` (default
``dapo``; ``luspo`` with the sequence-level importance ratio it requires) and
``scale_rewards`` (default ``group``). ``beta`` 0 (trl's default) and
temperature 1, so the gradient is REINFORCE's.
Design and derivations: docs/design/audit.md#audittrl_grpopy (Q3, Q4).
"""

from __future__ import annotations

import os
import tempfile

import torch

from exactstep.audit.hf_trainer import tiny_llama
from exactstep.audit.policy_probes import K, PolicyWindow
from exactstep.audit.protocol import ProbeSpec
from exactstep.audit.trl_sft import quiet_datasets, sft_tokenizer, word

LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
#: trl refuses ``luspo`` without sequence-level importance ratios (GSPO's).
SEQUENCE_LEVEL = ("luspo",)
SCALES = ("group", "batch", "none")


class TRLGRPOStep:
    """``PolicyStep`` over ``trl.GRPOTrainer`` with ``loss_type`` and ``scale_rewards``."""

    ranks = 2  # accelerate runs it as a DDP job when the launcher's environment is set
    initializes_process_group = True  # accelerate does, from that environment

    def __init__(self, loss_type: str = "dapo", scale_rewards: str = "group") -> None:
        from exactstep.errors import ConfigError

        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"unknown trl-grpo loss type {loss_type!r}; use one of "
                              f"{', '.join(LOSS_TYPES)}")
        if scale_rewards not in SCALES:
            raise ConfigError(f"unknown trl-grpo scale_rewards {scale_rewards!r}; use one "
                              f"of {', '.join(SCALES)}")
        self.loss_type, self.scale_rewards = loss_type, scale_rewards
        self.workdir = tempfile.TemporaryDirectory(prefix="exactstep-audit-grpo-")

    def build(self, spec: ProbeSpec) -> None:
        self.spec = spec
        self.module = tiny_llama(spec)  # the hf-trainer target's model

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=tokens).logits

    def config(self, window: PolicyWindow, micro_batch: int, world: int):  # noqa: ANN201
        from trl import GRPOConfig

        local = window.samples // world
        return GRPOConfig(
            output_dir=self.workdir.name, per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=local // micro_batch, num_generations=K,
            max_completion_length=max(len(c) for g in window.completions for c in g),
            loss_type=self.loss_type, scale_rewards=self.scale_rewards, beta=0.0,
            importance_sampling_level=("sequence" if self.loss_type in SEQUENCE_LEVEL
                                       else "token"),
            temperature=1.0, learning_rate=self.spec.lr, optim="sgd", max_grad_norm=0.0,
            lr_scheduler_type="constant", max_steps=1, logging_steps=1, report_to="none",
            save_strategy="no", use_cpu=True, bf16=False, seed=self.spec.seed,
            disable_tqdm=True, dataloader_num_workers=0, log_completions=False)

    def gradient(self, window: PolicyWindow, micro_batch: int,
                 ranks: int = 1) -> dict[str, torch.Tensor]:
        from datasets import Dataset
        from transformers import TrainerCallback
        from transformers.trainer_callback import PrinterCallback
        from trl import GRPOTrainer

        texts = [" ".join(word(t, self.spec) for t in p) for p in window.prompts]
        group = {text: g for g, text in enumerate(texts)}
        captured: dict[str, torch.Tensor] = {}

        def rollout(prompts: list, trainer: object) -> dict:
            handed: dict[int, int] = {}
            out = {"prompt_ids": [], "completion_ids": [], "logprobs": None,
                   "probe_reward": []}
            for text in prompts:
                g = group[text]
                k = handed[g] = handed.get(g, -1) + 1
                out["prompt_ids"].append(list(window.prompts[g]))
                out["completion_ids"].append(list(window.completions[g][k]))
                out["probe_reward"].append(window.rewards[g][k])
            return out

        def reward(prompts: list, completions: list, probe_reward: list,
                   **kwargs: object) -> list[float]:
            return list(probe_reward)

        class Capture(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
                model = kwargs["model"]
                model = getattr(model, "module", model)
                for name, p in model.named_parameters():
                    captured.setdefault(name, p.grad.detach().clone())

        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        with quiet_datasets():
            trainer = GRPOTrainer(
                model=self.module, reward_funcs=reward,
                args=self.config(window, micro_batch, ranks),
                train_dataset=Dataset.from_list([{"prompt": t} for t in texts]),
                processing_class=sft_tokenizer(self.spec), rollout_func=rollout,
                callbacks=[Capture()])
            trainer.remove_callback(PrinterCallback)
            if trainer.accelerator.num_processes != ranks:
                from exactstep.audit.probes import TargetFault

                raise TargetFault(f"accelerate runs {trainer.accelerator.num_processes} "
                                  f"processes where the probe started {ranks}")
            trainer.train()
        return captured


def make(variant: str = "") -> TRLGRPOStep:
    parts = [p for p in variant.split(":") if p] if variant else []
    if len(parts) > 2:
        from exactstep.errors import ConfigError

        raise ConfigError(f"trl-grpo variant {variant!r} reads LOSS_TYPE[:SCALE_REWARDS]")
    return TRLGRPOStep(*parts)
