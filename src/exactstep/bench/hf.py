"""exactstep driving a Hugging Face Llama against Hugging Face ``Trainer`` (H1, R3, R4, L1).

The same model, initial weights, data, optimizer and thread count on both sides;
passes alternate, and each side's training loop is timed on two workloads (``long``
text pieces, ``sft`` chat). ``exactstep bench hf`` reports supervised tokens per
second and ``speedup`` (Trainer's loop time over exactstep's).
Design and derivations: docs/design/bench.md#benchhfpy (H1, R3, R4, R5, L1).
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from exactstep.bench.common import interleaved_times, median
from exactstep.data.arith import ArithSpec, arith_conversations
from exactstep.data.config import DataConfig
from exactstep.data.corpus import load_corpus
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.model.config import ModelConfig
from exactstep.model.hf import HFCausalLM, build_hf_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.chat import ChatPolicy, chat_examples
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example, encode_documents
from exactstep.rows.stream import RowStream
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

#: the HF Llama of the benchmark: the built-in default's shape (``model.ModelConfig``)
LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 344,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
}
LR, BETAS, EPS, CLIP = 1e-3, (0.9, 0.999), 1e-8, 1.0
SEQ_LEN = 256
#: intra-op threads of both sides. One: on a shared machine, a second thread that loses
#: its core makes the other spin at every barrier, and single passes then vary by 10x
THREADS = 1


@dataclass(frozen=True)
class Workload:
    """One comparison: ``examples`` for exactstep, ``items`` (the same tokens as HF
    dataset rows) for Trainer, exactstep's rows per window and Trainer's collator."""

    name: str
    examples: list[Example]
    items: list[dict[str, list[int]]]
    rows: int
    collator: str  # "lm" or "seq2seq"
    seq_len: int = SEQ_LEN  # exactstep's row length


# ------------------------------------------------------------------------------ data


def long_documents(budget: int, seed: int = 0) -> list[Example]:
    """Standard-library files (training split) as ``BOS + bytes + EOS``: in a fixed
    shuffled order, each file that still fits in ``budget`` tokens, until 90% of it
    is filled."""
    corpus = load_corpus(DataConfig(source="stdlib"))
    order = np.random.default_rng(seed).permutation(len(corpus.train))
    chosen, total = [], 0
    for index in order.tolist():
        document = corpus.train[index]
        size = len(document.text.encode("utf-8")) + 2
        if total + size <= budget:
            chosen.append(document)
            total += size
        if total >= 0.9 * budget:
            break
    return encode_documents(chosen, ByteTokenizer())


def pieces_of(examples: Sequence[Example], seq_len: int) -> list[dict[str, list[int]]]:
    """Each example cut into consecutive pieces of at most ``seq_len`` tokens: the rows
    Trainer trains on, the same pieces exactstep's ``overlong = "split"`` packs."""
    items = []
    for example in examples:
        tokens = example.tokens.tolist()
        items.extend({"input_ids": tokens[s : s + seq_len]} for s in range(0, len(tokens), seq_len))
    return items


def sft_examples(n: int, seed: int = 0) -> list[Example]:
    """``n`` arithmetic conversations (one or two user turns) rendered by the built-in
    chat template, owning the assistant answers and their end-of-turn (R5)."""
    spec = ArithSpec(n_train=n, min_follow_ups=0, max_follow_ups=1)
    conversations = arith_conversations(seed, n, split="train", spec=spec)
    examples, _ = chat_examples(conversations, ByteTokenizer(), ChatPolicy(), max_len=SEQ_LEN)
    return examples


def labelled_items(examples: Sequence[Example]) -> list[dict[str, list[int]]]:
    """HF rows with ``labels`` = the token where it is an owned target, else -100."""
    items = []
    for example in examples:
        labels = np.where(example.owned, example.tokens, IGNORE_INDEX)
        items.append({"input_ids": example.tokens.tolist(), "labels": labels.tolist()})
    return items


def workloads(quick: bool) -> list[Workload]:
    long_tokens, sft_n = (2_000, 48) if quick else (60_000, 1_000)
    docs = long_documents(long_tokens)
    sft = sft_examples(sft_n)
    return [
        Workload("long", docs, pieces_of(docs, SEQ_LEN), rows=16, collator="lm"),
        Workload("sft", sft, labelled_items(sft), rows=8, collator="seq2seq"),
    ]


# --------------------------------------------------------------------------- exactstep


class ExactstepSide:
    """One pass = a fresh ``RowStream`` over the examples (one epoch, finite), a
    fresh engine and AdamW, every window committed through ``run_window``."""

    def __init__(self, model: HFCausalLM, initial: dict, workload: Workload, pad_id: int,
                 vocab_size: int) -> None:
        self.model, self.initial, self.workload = model, initial, workload
        self.batch_cfg = BatchConfig(seq_len=workload.seq_len, rows=workload.rows)
        self.pad_id, self.vocab_size = pad_id, vocab_size
        self.update_cfg = UpdateConfig(lr=LR, schedule="constant", warmup=0, clip=CLIP,
                                       weight_decay=0.0, beta1=BETAS[0], beta2=BETAS[1], eps=EPS)
        self.last: dict[str, Any] = {}

    def stream(self) -> RowStream:
        return RowStream(self.workload.examples, self.batch_cfg, pad_id=self.pad_id, seed=0,
                         repeat=False, vocab_size=self.vocab_size)

    def windows(self) -> int:
        """Windows of one pass (packing only, untimed; sets Trainer's batch size)."""
        return sum(1 for _ in self.stream())

    def __call__(self, limit: int | None = None) -> None:
        self.model.hf.load_state_dict(self.initial)
        optimizer, _ = build_optimizer(self.model, self.update_cfg)
        engine = UpdateEngine(self.model, optimizer, build_schedule(self.update_cfg, 1 << 30),
                              Precision(NumericsConfig(precision="fp32"), "cpu"),
                              self.update_cfg, ObjectiveConfig(), device="cpu",
                              pad_id=self.pad_id)
        stream = self.stream()
        losses, slots = [], 0
        started = time.perf_counter()  # the training loop only, as for Trainer
        for window, batch in enumerate(stream):
            if limit is not None and window >= limit:
                break
            disposition = engine.run_window([batch], window)
            losses.append(disposition.loss)
            slots += batch.input_ids.numel()
        seconds = time.perf_counter() - started
        self.last = {"seconds": seconds, "supervised_tokens": engine.tokens, "slots": slots,
                     "real_tokens": stream.report()["real_tokens"], "updates": engine.committed,
                     "loss": float(np.mean(losses)) if losses else None}


# ------------------------------------------------------------------------ Hugging Face


class CountingCollator:
    """A Hugging Face collator, counting what each batch supervises and holds.

    ``supervised_tokens``: labels that are targets after the model's shift (columns
    1.. of ``labels`` that are not -100); ``slots``/``real_tokens``: row slots and the
    ones under ``attention_mask``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.supervised_tokens = self.slots = self.real_tokens = 0

    def __call__(self, features: list[dict]) -> dict:
        batch = self.inner(features)
        self.supervised_tokens += int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        self.slots += batch["input_ids"].numel()
        self.real_tokens += int(batch["attention_mask"].sum())
        return batch


def hf_collator(kind: str, tokenizer: Any) -> Any:
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    if kind == "lm":
        return DataCollatorForLanguageModeling(tokenizer=tokenizer, mlm=False)
    return DataCollatorForSeq2Seq(tokenizer=tokenizer, padding="longest",
                                  label_pad_token_id=IGNORE_INDEX)


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


class LoopClock:
    """A ``TrainerCallback`` timing Trainer's training loop: from ``on_train_begin``
    (model, optimizer, schedule and dataloader ready) to ``on_train_end``, so the
    once-per-run setup of ``Trainer.train()`` is not charged to every pass."""

    def __init__(self) -> None:
        self.started = self.seconds = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds = time.perf_counter() - self.started

    def __getattr__(self, name: str) -> Any:  # every other event: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


class TrainerSide:
    """One pass = ``Trainer.train()`` for one epoch from the initial weights, with a
    fresh optimizer and schedule (what a new run does)."""

    def __init__(self, model: Any, initial: dict, workload: Workload, tokenizer: Any,
                 batch_size: int, out_dir: str) -> None:
        from transformers import PrinterCallback, Trainer, TrainingArguments

        self.model, self.initial = model, initial
        self.collator = CountingCollator(hf_collator(workload.collator, tokenizer))
        self.args = TrainingArguments(
            output_dir=out_dir, per_device_train_batch_size=batch_size, num_train_epochs=1,
            learning_rate=LR, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS,
            weight_decay=0.0, max_grad_norm=CLIP, lr_scheduler_type="constant", warmup_steps=0,
            eval_strategy="no", save_strategy="no", report_to=[], dataloader_num_workers=0,
            dataloader_pin_memory=False, use_cpu=True, disable_tqdm=True, seed=0,
        )
        self.trainer = Trainer(model=model, args=self.args, train_dataset=ListDataset(workload.items),
                               data_collator=self.collator)
        self.trainer.remove_callback(PrinterCallback)  # it prints the end-of-train metrics
        self.clock = LoopClock()
        self.trainer.add_callback(self.clock)
        self.last: dict[str, Any] = {}

    def __call__(self, limit: int | None = None) -> None:
        self.model.load_state_dict(self.initial)
        self.trainer.optimizer, self.trainer.lr_scheduler = None, None
        self.trainer.args.max_steps = limit if limit is not None else -1
        self.collator.reset()
        output = self.trainer.train()
        self.last = {"seconds": self.clock.seconds,
                     "supervised_tokens": self.collator.supervised_tokens,
                     "slots": self.collator.slots, "real_tokens": self.collator.real_tokens,
                     "updates": output.global_step, "loss": float(output.training_loss)}


# ------------------------------------------------------------------------------ run


def build_models() -> tuple[HFCausalLM, Any, dict]:
    """exactstep's adapter (checked by ``build_hf_model``'s probe) and an identical
    HF model for Trainer; the initial weights both reset to."""
    tokenizer = ByteTokenizer()
    # sdpa on both sides: the twin Trainer runs is a copy of this very model
    adapter = build_hf_model(ModelConfig(source="hf", hf_config=dict(LLAMA),
                                         attn_implementation="sdpa"),
                             tokenizer.vocab_size, seed=0)
    twin = copy.deepcopy(adapter.hf)
    twin.config.pad_token_id = tokenizer.pad_id
    initial = {k: v.detach().clone() for k, v in adapter.hf.state_dict().items()}
    return adapter, twin, initial


def compare(workload: Workload, models: tuple, repeats: int, threads: int, out_dir: str) -> dict:
    """Interleaved passes of both sides over ``workload``; its figures, prefixed.

    ``speedup`` is the median over passes of (Trainer's loop seconds / exactstep's
    loop seconds), each pair measured back to back; ``speedup_whole_pass`` the same
    with each side's per-pass setup included (Trainer.train()'s preparation, a new
    engine and stream).
    """
    from exactstep.artifacts.export import byte_tokenizer_hf

    tokenizer = ByteTokenizer()
    adapter, twin, initial = models
    exact = ExactstepSide(adapter, initial, workload, tokenizer.pad_id, tokenizer.vocab_size)
    batch_size = max(1, round(len(workload.items) / exact.windows()))
    hf = TrainerSide(twin, initial, workload, byte_tokenizer_hf(tokenizer), batch_size, out_dir)
    passes: dict[str, list[dict]] = {"exactstep": [], "trainer": []}

    def pass_of(side: Any, name: str) -> Any:
        def one_pass() -> None:
            torch.set_num_threads(threads)
            side()
            passes[name].append(side.last)
        return one_pass

    exact(limit=1)  # warm both up on one step, untimed
    hf(limit=1)
    whole_e, whole_t = interleaved_times(pass_of(exact, "exactstep"), pass_of(hf, "trainer"),
                                         repeats=repeats, warmup=0)
    loop_e = [p["seconds"] for p in passes["exactstep"]]
    loop_t = [p["seconds"] for p in passes["trainer"]]
    first_e, first_t = passes["exactstep"][0], passes["trainer"][0]
    ratios = [t / e for e, t in zip(loop_e, loop_t, strict=True)]
    return {f"{workload.name}_{key}": value for key, value in {
        "speedup": median(ratios),
        "speedup_per_pass": ratios,
        "speedup_whole_pass": median([t / e for e, t in zip(whole_e, whole_t, strict=True)]),
        "supervised_tokens_per_s": first_e["supervised_tokens"] / median(loop_e),
        "baseline_supervised_tokens_per_s": first_t["supervised_tokens"] / median(loop_t),
        "supervised_tokens": [p["supervised_tokens"] for p in passes["exactstep"]],
        "baseline_supervised_tokens": [p["supervised_tokens"] for p in passes["trainer"]],
        "examples": len(workload.examples),
        "rows": len(workload.items),
        "updates": first_e["updates"],
        "baseline_updates": first_t["updates"],
        "baseline_batch_size": batch_size,
        "real_token_fraction": first_e["real_tokens"] / first_e["slots"],
        "baseline_real_token_fraction": first_t["real_tokens"] / first_t["slots"],
        "pass_loss": first_e["loss"],
        "baseline_pass_loss": first_t["loss"],
    }.items()}


def run(quick: bool) -> dict:
    repeats = 1 if quick else 7
    figures: dict = {"threads": THREADS, "seq_len": SEQ_LEN, "repeats": repeats}
    previous = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory() as out_dir, quiet_hf():
            torch.set_num_threads(THREADS)
            models = build_models()
            for workload in workloads(quick):
                figures.update(compare(workload, models, repeats, THREADS, out_dir))
    finally:
        torch.set_num_threads(previous)
    return figures


class quiet_hf:
    """HF's info logs and warnings silenced during the benchmark; restored after."""

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.logging = logging
        self.verbosity = logging.get_verbosity()
        logging.set_verbosity_error()
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.simplefilter("ignore")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def __exit__(self, *exc: object) -> None:
        self.warnings.__exit__(*exc)
        self.logging.set_verbosity(self.verbosity)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
