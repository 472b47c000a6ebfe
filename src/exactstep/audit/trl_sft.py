"""The ``trl-sft`` target: ``trl``'s ``SFTTrainer`` behind ``TrainingStep`` (A1).

Driven like ``hf-trainer`` (the same tiny ``LlamaForCausalLM``, the same options mapped
to ``SFTConfig``), except that ``SFTTrainer`` prepares the data itself: it tokenizes,
builds the labels from the masks, packs and collates; the probe fixes only which
prepared rows form each microbatch. Variants: ``completion_only_loss`` (default),
``assistant_only_loss``, ``padding_free`` and ``packing``.
Design and derivations: docs/design/audit.md#audittrl_sftpy (A1).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

from exactstep.audit.hf_trainer import HFTrainerStep
from exactstep.audit.probes import NotApplicable
from exactstep.audit.protocol import Microbatch, ProbeSpec

VARIANTS = ("completion_only_loss", "assistant_only_loss", "padding_free", "packing")
COLUMN = "probe_microbatch"  # which probe microbatch a dataset example belongs to
# BOS, then each message as " content"; only assistant content is a generation span.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ ' ' }}{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}"
)


class TRLSFTStep(HFTrainerStep):
    """``TrainingStep`` over ``trl.SFTTrainer``.

    ``variant``: ``completion_only_loss`` (default), ``assistant_only_loss``,
    ``padding_free`` or ``packing``. Resume and the loop's own data order are
    ``NotApplicable``: ``SFTTrainer`` prepares its dataset on every call.
    """

    def __init__(self, variant: str = "completion_only_loss") -> None:
        if variant not in VARIANTS:
            from exactstep.errors import ConfigError

            raise ConfigError(f"unknown trl-sft variant {variant!r}; use one of "
                              f"{', '.join(VARIANTS)}")
        flat = variant in ("padding_free", "packing")
        super().__init__("flattening" if flat else "padding")  # rows and logits() as fed
        self.variant = variant

    def make_trainer(self, spec: ProbeSpec) -> None:
        """The trainer is made per call, with the data it prepares; the optimizer is
        carried from one call to the next, as one ``Trainer`` keeps it."""
        self.tokenizer = sft_tokenizer(spec)
        self.optimizer = None
        return None

    def config(self, spec: ProbeSpec):  # noqa: ANN201
        from trl import SFTConfig

        return SFTConfig(
            **self.arguments(spec), bf16=False,
            completion_only_loss=self.variant != "assistant_only_loss" or None,
            assistant_only_loss=self.variant == "assistant_only_loss",
            padding_free=self.variant == "padding_free", packing=self.variant == "packing",
            max_length=None if self.variant == "padding_free" else 1024,  # trl refuses both
        )

    def dataset(self, microbatches: Sequence[Microbatch]):  # noqa: ANN201
        from datasets import Dataset

        rows, self.owner = [], {}
        for k, mb in enumerate(microbatches):
            for r in range(mb.tokens.shape[0]):
                for ids, owned in self.row_examples(mb, r):
                    self.owner.setdefault(tuple(ids), set()).add(k)
                    rows.append({**self.example(ids, owned), COLUMN: k})
        return Dataset.from_list(rows)

    def example(self, ids: list[int], owned: list[bool]) -> dict:
        if self.variant != "assistant_only_loss":
            return {"input_ids": ids, "completion_mask": [int(o) for o in owned]}
        return {"messages": messages(ids, owned, self.spec)}

    def sft_trainer(self, train_dataset):  # noqa: ANN001, ANN201
        """A stock ``SFTTrainer`` (with the probe's dataloaders) that has prepared
        ``train_dataset``, holding the optimizer of the previous call."""
        from transformers.trainer_callback import PrinterCallback

        with quiet_datasets():
            trainer = probe_sft_trainer_class()(
                model=self.module, args=self.config(self.spec), train_dataset=train_dataset,
                processing_class=self.tokenizer)
        trainer.remove_callback(PrinterCallback)
        trainer.probe_owner = self.owner
        trainer.optimizer = self.optimizer
        return trainer

    def train(self, microbatches: Sequence[Microbatch]) -> list[float | None]:
        self.trainer = self.sft_trainer(self.dataset(microbatches))
        if len(self.trainer.train_dataset) == 0:
            raise NotApplicable("SFTTrainer dropped every example before training (with "
                                "max_length set it filters out examples without a target)")
        self.trainer.train()
        self.module.train()
        self.optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        return [entry["loss"] for entry in self.trainer.state.log_history if "loss" in entry]

    def set_data(self, windows: Sequence[Sequence[Microbatch]]) -> None:
        raise NotApplicable("not driven for SFTTrainer: it prepares its dataset per "
                            "train() (datasets.map, packing) and resumes only from its "
                            "checkpoint directory; hf-trainer measures the Trainer's data "
                            "skip on resume")

    def train_steps(self, n: int) -> list[float | None]:
        raise NotApplicable("not driven for SFTTrainer (see set_data)")

    def evaluate(self, microbatches: Sequence[Microbatch]) -> tuple[float, float]:
        """``SFTTrainer.evaluate`` prepares the rows (trl requires a train dataset to
        build the trainer: the same rows, not trained on)."""
        rows = self.dataset(microbatches)
        trainer = self.sft_trainer(rows)
        with quiet_datasets():
            loss = float(trainer.evaluate(eval_dataset=rows)["eval_loss"])
        return loss, math.exp(loss)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No ``datasets`` progress bars while trl prepares the probe's few rows."""
    import datasets

    was_disabled = datasets.is_progress_bar_enabled() is False
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def messages(ids: list[int], owned: list[bool], spec: ProbeSpec) -> list[dict]:
    """A document (``BOS`` first) as a conversation: each run of unowned tokens a
    ``user`` turn, each run of owned tokens an ``assistant`` turn (R5)."""
    if ids[0] != spec.bos_id or owned[0]:
        raise ValueError("a probe document starts with an unowned BOS")
    turns: list[dict] = []
    for token, own in zip(ids[1:], owned[1:], strict=True):
        role = "assistant" if own else "user"
        if not turns or turns[-1]["role"] != role:
            turns.append({"role": role, "content": []})
        turns[-1]["content"].append(word(token, spec))
    return [{"role": t["role"], "content": " ".join(t["content"])} for t in turns]


def word(token: int, spec: ProbeSpec) -> str:
    return {spec.pad_id: "<pad>", spec.bos_id: "<s>", spec.eos_id: "</s>"}.get(token,
                                                                             f"w{token}")


def sft_tokenizer(spec: ProbeSpec):  # noqa: ANN201
    """A whitespace word-level tokenizer over the probe's ids with the chat template:
    ``<pad>``, ``<s>``, ``</s>`` are the special tokens, ``wI`` content token ``I``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i, spec): i for i in range(spec.vocab_size)}
    core = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>")
    tok.padding_side = "right"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def probe_sft_trainer_class() -> type:
    """``SFTTrainer`` whose dataloaders yield the probe's microbatches of the rows trl
    prepared, in order; everything else is the stock ``SFTTrainer``."""
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    class ProbeSFTTrainer(SFTTrainer):
        probe_owner: dict = {}

        def probe_loader(self, dataset) -> DataLoader:  # noqa: ANN001
            loader = DataLoader(dataset, batch_sampler=self.probe_batches(dataset),
                                collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

        def probe_batches(self, dataset) -> list[list[int]]:  # noqa: ANN001
            """Row indices per probe microbatch; ``NotApplicable`` when trl packed
            documents of different microbatches into one row."""
            owners = [self.owner_of(dataset[i]) for i in range(len(dataset))]
            return [[i for i, k in enumerate(owners) if k == m]
                    for m in sorted(set(owners))]

        def owner_of(self, row: dict) -> int:
            if COLUMN in row:
                return int(row[COLUMN])
            lengths = row.get("seq_lengths") or [len(row["input_ids"])]
            ids, owners, start = row["input_ids"], set(), 0
            for n in lengths:
                owners |= self.probe_owner.get(tuple(ids[start:start + n]), {-1})
                start += n
            if len(owners) != 1 or -1 in owners:
                raise NotApplicable("trl's packing put documents of different probe "
                                    "microbatches in one row: the windows are trl's")
            return owners.pop()

        def get_train_dataloader(self) -> DataLoader:
            return self.probe_loader(self.train_dataset)

        def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:  # noqa: ANN001
            return self.probe_loader(eval_dataset)

    return ProbeSFTTrainer


def make(variant: str = "completion_only_loss") -> TRLSFTStep:
    return TRLSFTStep(variant)
