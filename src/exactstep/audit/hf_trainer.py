"""The ``hf-trainer`` target: Hugging Face ``Trainer`` behind ``TrainingStep`` (A1).

What is audited is ``transformers.Trainer`` as users run it, on a tiny random-init
``LlamaForCausalLM`` (nothing downloaded). The probe fixes only which examples form each
microbatch; the collator (``hf-trainer:padding``, the default, or ``:flattening``), the
accumulation, the loss normalization, the optimizer groups, the scheduler and the step
are the Trainer's. ``hf-trainer:lora`` is the padding collator on a ``peft`` LoRA model
(Trainer + peft, as users fine-tune with adapters).
Design and derivations: docs/design/audit.md#audithf_trainerpy (A1, S2).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from exactstep.audit.probes import NotApplicable
from exactstep.audit.protocol import Microbatch, ProbeSpec

COLLATORS = ("padding", "flattening")
VARIANTS = (*COLLATORS, "lora")  # lora: the padding collator, the model wrapped by peft


class HFTrainerStep:
    """``TrainingStep`` over ``transformers.Trainer``.

    ``collator``: ``padding`` (``DataCollatorForSeq2Seq``, a packed row is one example)
    or ``flattening`` (``DataCollatorWithFlattening``, one example per document);
    ``lora`` is ``padding`` with the model wrapped by ``peft.get_peft_model`` (rank 4
    on every linear layer but the head, adapters initialised non-zero so that the
    first update moves both factors); the probes then watch the adapters, the only
    trainable parameters.
    ``save``/``load`` work only for the loop's own data (``set_data``/``train_steps``,
    through the Trainer's checkpoints; ``ignore_data_skip`` turns off its data skip on
    resume), else ``NotApplicable``; so is a loss scale without CUDA.
    """

    smoothing_convention = "uniform"  # TrainingArguments.label_smoothing_factor

    def __init__(self, collator: str = "padding", *, ignore_data_skip: bool = False) -> None:
        if collator not in VARIANTS:
            from exactstep.errors import ConfigError

            raise ConfigError(f"unknown hf-trainer variant {collator!r}; use one of "
                              f"{', '.join(VARIANTS)}")
        self.lora = collator == "lora"
        self.collator = "padding" if self.lora else collator
        self.ignore_data_skip = ignore_data_skip
        self.workdir = tempfile.TemporaryDirectory(prefix="exactstep-audit-hf-")
        self.builds = 0

    def build(self, spec: ProbeSpec) -> None:
        if spec.loss_scale is not None and not torch.cuda.is_available():
            raise NotApplicable("Trainer scales the loss only under fp16, which needs CUDA")
        self.spec = spec
        self.module = tiny_llama(spec)
        if self.lora:
            self.module = with_adapters(self.module, spec)
        self.trainer = self.make_trainer(spec)
        self.builds += 1  # each build its own checkpoint directory
        self.data_rows: list[dict] | None = None
        self.steps_done, self.resume_from = 0, None

    def make_trainer(self, spec: ProbeSpec, **overrides: object):  # noqa: ANN201
        from transformers import TrainingArguments
        from transformers.trainer_callback import PrinterCallback

        args = TrainingArguments(**{**self.arguments(spec), **overrides})
        trainer = probe_trainer_class()(model=self.module, args=args,
                                        data_collator=self.data_collator())
        trainer.remove_callback(PrinterCallback)  # the audit prints its own table
        return trainer

    def arguments(self, spec: ProbeSpec) -> dict:
        """``TrainingArguments`` for ``spec``, as users set them (the ``trl`` target
        passes the same to ``SFTConfig``)."""
        return dict(
            output_dir=self.workdir.name, per_device_train_batch_size=1,
            gradient_accumulation_steps=spec.accum, learning_rate=spec.lr,
            lr_scheduler_type="constant_with_warmup" if spec.warmup else "constant",
            warmup_steps=spec.warmup, max_grad_norm=spec.clip if spec.clip > 0 else 0.0,
            weight_decay=spec.weight_decay, adam_beta1=spec.betas[0],
            adam_beta2=spec.betas[1], adam_epsilon=spec.eps,
            optim="adamw_torch" if spec.optimizer == "adamw" else "sgd",
            label_smoothing_factor=spec.label_smoothing, num_train_epochs=1,
            logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
            seed=spec.seed, train_sampling_strategy="sequential", disable_tqdm=True,
            dataloader_num_workers=0, remove_unused_columns=False,
            fp16=spec.loss_scale is not None and torch.cuda.is_available(),
        )

    def data_collator(self):  # noqa: ANN201
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

        if self.collator == "flattening":
            return DataCollatorWithFlattening(return_position_ids=True)
        return DataCollatorForSeq2Seq(tokenizer(self.spec), padding=True,
                                      label_pad_token_id=-100)

    def examples(self, microbatches: Sequence[Microbatch]) -> tuple[list[dict], list[list[int]]]:
        """Dataset rows and the probe's batches of row indices."""
        rows, batches = [], []
        for mb in microbatches:
            batch = []
            for r in range(mb.tokens.shape[0]):
                for ids, owned in self.row_examples(mb, r):
                    batch.append(len(rows))
                    labels = [t if o else -100 for t, o in zip(ids, owned, strict=True)]
                    rows.append({"input_ids": ids, "labels": labels,
                                 **({} if self.collator == "flattening"
                                    else {"attention_mask": [1] * len(ids)})})
            batches.append(batch)
        return rows, batches

    def row_examples(self, mb: Microbatch, r: int) -> list[tuple[list[int], list[bool]]]:
        real = mb.documents[r] > 0
        if self.collator == "padding":  # a packed row is one example
            return [(mb.tokens[r][real].tolist(), mb.owned[r][real].tolist())]
        return [(mb.tokens[r][mb.documents[r] == d].tolist(),
                 mb.owned[r][mb.documents[r] == d].tolist())
                for d in mb.documents[r].unique().tolist() if d > 0]

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               document_ids: torch.Tensor) -> torch.Tensor:
        """The model as each collator feeds it in training: a padding mask
        (``padding``) or per-document ``position_ids`` and no mask (``flattening``)."""
        if self.collator == "flattening":  # use_cache=False as in training (see AUDIT.md)
            return self.module(input_ids=input_ids, position_ids=position_ids,
                               use_cache=False).logits
        return self.module(input_ids=input_ids, attention_mask=(document_ids > 0).long(),
                           use_cache=False).logits

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        rows, batches = self.examples(microbatches)
        self.trainer.train_dataset = rows
        self.trainer.probe_batches = batches
        seen = len(self.trainer.state.log_history)
        self.trainer.train()
        self.module.train()
        history = self.trainer.state.log_history[seen:]
        return [entry["loss"] for entry in history if "loss" in entry]

    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        rows, batches = self.examples(microbatches)
        self.trainer.probe_batches = batches
        loss = float(self.trainer.evaluate(eval_dataset=rows)["eval_loss"])
        return loss, math.exp(loss)

    def set_data(self, windows: Sequence[Sequence[Microbatch]]) -> None:
        """The Trainer's own ``train_dataset``: every row of every window's microbatches;
        its sampler batches them ``rows per microbatch`` at a time (one window each with
        ``accum`` 1)."""
        microbatches = [mb for window in windows for mb in window]
        self.data_rows, _ = self.examples(microbatches)
        self.data_batch = microbatches[0].tokens.shape[0]
        self.steps_done, self.resume_from = 0, None

    def checkpoints(self) -> Path:
        return Path(self.workdir.name) / f"build-{self.builds}"

    def train_steps(self, n: int) -> list[float | None]:
        """``Trainer.train`` up to ``max_steps = steps so far + n``, from the Trainer's
        latest checkpoint (or the loaded one) when there is one."""
        if self.data_rows is None:
            raise ValueError("train_steps() needs set_data() first")
        resume = self.resume_from
        if resume is None and self.steps_done:
            resume = str(self.checkpoints() / f"checkpoint-{self.steps_done}")
        self.trainer = self.make_trainer(
            self.spec, output_dir=str(self.checkpoints()), max_steps=self.steps_done + n,
            save_strategy="steps", save_steps=1, train_sampling_strategy="random",
            per_device_train_batch_size=self.data_batch,
            ignore_data_skip=self.ignore_data_skip)
        self.trainer.train_dataset = self.data_rows
        self.trainer.probe_batches = None  # the stock dataloader and sampler
        before = self.steps_done
        with quiet_checkpoints():
            self.trainer.train(resume_from_checkpoint=resume)
        self.module.train()
        self.steps_done, self.resume_from = self.trainer.state.global_step, None
        return [entry["loss"] for entry in self.trainer.state.log_history
                if "loss" in entry and entry["step"] > before]

    def save(self, path: Path) -> None:
        if self.data_rows is None or not self.steps_done:
            raise NotApplicable("Trainer resumes only by replaying its own dataset from a "
                                "checkpoint (resume_from_checkpoint)")
        shutil.copytree(self.checkpoints() / f"checkpoint-{self.steps_done}", path)

    def load(self, path: Path) -> None:
        if self.data_rows is None:
            raise NotApplicable("Trainer resumes only from its own checkpoint directory")
        state = json.loads((Path(path) / "trainer_state.json").read_text())
        self.steps_done, self.resume_from = int(state["global_step"]), str(path)


def with_adapters(model: torch.nn.Module, spec: ProbeSpec) -> torch.nn.Module:
    """``model`` wrapped by ``peft`` as users do: rank 4, alpha 8, every linear layer
    but the head, adapter dropout ``spec.dropout``; ``init_lora_weights=False`` draws
    both factors (from the seeded global RNG, like the model), so the adapters change
    the logits from the start and every probe sees them."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=spec.dropout,
                        target_modules="all-linear", init_lora_weights=False,
                        task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' deprecated checkpointing flag
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return get_peft_model(model, config)


@contextlib.contextmanager
def quiet_checkpoints() -> Iterator[None]:
    """No progress bar while the Trainer writes its checkpoints (the audit prints its
    own table); the caller's setting is restored."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def tiny_llama(spec: ProbeSpec) -> torch.nn.Module:
    """The probes' random-init ``LlamaForCausalLM`` (``spec``'s shapes, seeded, tied
    head, SDPA), built from a config: nothing is downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.d_model,
        intermediate_size=2 * spec.d_model, num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_heads,
        max_position_embeddings=64, tie_word_embeddings=True,
        attention_dropout=spec.dropout, pad_token_id=spec.pad_id,
        bos_token_id=spec.bos_id, eos_token_id=spec.eos_id, attn_implementation="sdpa"))


def probe_trainer_class() -> type:
    """``Trainer`` whose dataloaders yield exactly the probe's microbatches (in order);
    everything else is the stock ``Trainer``."""
    from torch.utils.data import DataLoader
    from transformers import Trainer

    class ProbeTrainer(Trainer):
        probe_batches: list[list[int]] = []

        def get_train_dataloader(self) -> DataLoader:
            if self.probe_batches is None:  # the loop's own data: the stock dataloader
                return super().get_train_dataloader()
            loader = DataLoader(self.train_dataset, batch_sampler=self.probe_batches,
                                collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:  # noqa: ANN001
            loader = DataLoader(eval_dataset, batch_sampler=self.probe_batches,
                                collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

    return ProbeTrainer


def tokenizer(spec: ProbeSpec):  # noqa: ANN201
    """A word-level tokenizer over the probe's ids, only for the collator's padding."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(spec.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                  pad_token=f"t{spec.pad_id}")
    tok.padding_side = "right"
    return tok


def make(collator: str = "padding") -> HFTrainerStep:
    return HFTrainerStep(collator)
