"""Fine-tuning a Qwen2-shaped model (vocabulary 151,936) against HF ``Trainer`` (H1, H4, H5, L1).

Full fine-tuning and LoRA (``Trainer`` + ``peft``), each with and without activation
checkpointing, on SFT chats of varied length with assistant-only targets (R5). Every
side runs in a fresh interpreter, in alternation, so its peak resident set is its own.
``exactstep bench finetune`` reports supervised tokens per second, peak RSS and the
ratios exactstep/Trainer (``peak_rss_ratio``, ``tokens_per_s_ratio``) per variant.
Design and derivations: docs/design/bench.md#benchfinetunepy (H1, H4, H5, L1).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exactstep.bench.common import run_child

#: the model: Qwen2.5's vocabulary and tied head, GQA heads 4:1, depth and width
#: reduced so a pass fits in minutes on two CPU cores; random init from the config
QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 151_936,
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "initializer_range": 0.02,
}
#: the data of one pass: arithmetic chats (short) and chats whose answer is a stretch
#: of a standard-library file of ``long_tokens`` bytes (long); ``rows`` rows of
#: ``seq_len`` per exactstep window
FULL = {"seq_len": 1024, "rows": 1, "short": 12, "long": 6, "long_tokens": (160, 940),
        "repeats": 1}
QUICK = {"seq_len": 256, "rows": 1, "short": 4, "long": 2, "long_tokens": (60, 200),
         "repeats": 1}
LORA = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
#: intra-op threads of every side of the headline variants. One: on a shared machine a
#: second thread that loses its core makes the other wait at every barrier (see
#: ``bench hf``); the ``*_2t`` variants run both sides at two, PyTorch's default here
THREADS = 1
VARIANTS = {"full": (False, False, THREADS), "lora": (True, False, THREADS),
            "full_ac": (False, True, THREADS), "lora_ac": (True, True, THREADS),
            "full_2t": (False, False, 2), "lora_2t": (True, False, 2)}
#  name: (LoRA, activation checkpointing, intra-op threads)
CHILD_MODULE = "exactstep.bench.finetune"


# ------------------------------------------------------------------------ parent side


def run(quick: bool) -> dict:
    shape = dict(QUICK if quick else FULL)
    repeats = shape.pop("repeats")
    figures: dict[str, Any] = {
        "threads": THREADS, "repeats": repeats, "model": {k: v for k, v in QWEN2.items()},
        "lora": dict(LORA), **{k: list(v) if isinstance(v, tuple) else v
                               for k, v in shape.items()},
    }
    passes: dict[str, list[dict]] = {}
    for repeat in range(repeats):
        for variant, (lora, ac, threads) in VARIANTS.items():
            sides = ("exactstep", "trainer") if repeat % 2 == 0 else ("trainer", "exactstep")
            for side in sides:
                spec = {"side": side, "lora": lora, "ac": ac, "threads": threads,
                        "model": QWEN2, "lora_config": LORA, "data": shape}
                passes.setdefault(f"{variant}_{side}", []).append(child(spec))
    for variant in VARIANTS:
        figures.update(summarise(variant, passes[f"{variant}_exactstep"],
                                 passes[f"{variant}_trainer"]))
    return figures


def summarise(variant: str, exact: list[dict], hf: list[dict]) -> dict:
    """One variant's figures: medians over passes, and the ratios exactstep/Trainer."""
    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2] if len(xs) % 2 else sum(sorted(xs)[len(xs) // 2 - 1:
                                                                         len(xs) // 2 + 1]) / 2

    out: dict[str, Any] = {}
    for name, passes in (("exactstep", exact), ("trainer", hf)):
        out[f"{name}_tokens_per_s"] = med([p["supervised_tokens"] / p["seconds"] for p in passes])
        out[f"{name}_peak_rss_mib"] = med([p["peak_rss_mib"] for p in passes])
        out[f"{name}_built_rss_mib"] = med([p["built_rss_mib"] for p in passes])
        out[f"{name}_import_rss_mib"] = med([p["import_rss_mib"] for p in passes])
        out[f"{name}_loop_s"] = [p["seconds"] for p in passes]
        out[f"{name}_supervised_tokens"] = [p["supervised_tokens"] for p in passes]
        out[f"{name}_updates"] = passes[0]["updates"]
        out[f"{name}_trainable_parameters"] = passes[0]["trainable_parameters"]
        out[f"{name}_real_token_fraction"] = passes[0]["real_tokens"] / passes[0]["slots"]
        out[f"{name}_pass_loss"] = passes[0]["loss"]
    out["peak_rss_ratio"] = out["exactstep_peak_rss_mib"] / out["trainer_peak_rss_mib"]
    out["tokens_per_s_ratio"] = out["exactstep_tokens_per_s"] / out["trainer_tokens_per_s"]
    out["same_targets"] = out["exactstep_supervised_tokens"] == out["trainer_supervised_tokens"]
    out["trainer_batch_size"] = hf[0]["batch_size"]
    return {f"{variant}_{k}": v for k, v in out.items()}


def child(spec: dict) -> dict:
    """One side's pass in a fresh interpreter (``python -m exactstep.bench.finetune``),
    so its ``VmHWM`` is its own: imports, model build, data and training."""
    return run_child(CHILD_MODULE, spec, "finetune")


# ------------------------------------------------------------------------------- data


def finetune_examples(data: dict) -> list:
    """The pass's chats, interleaved short and long in a fixed order: ``short``
    arithmetic chats and ``long`` chats asking for a stretch of a standard-library
    file, the answer that stretch (``long_tokens`` bytes, drawn uniformly); the
    assistant's answers and end-of-turn are the targets (R5)."""
    import numpy as np

    from exactstep.data.arith import ArithSpec, arith_conversations
    from exactstep.data.config import DataConfig
    from exactstep.data.conversation import Conversation, Message
    from exactstep.data.corpus import load_corpus
    from exactstep.data.tokenizer import ByteTokenizer
    from exactstep.rows.chat import ChatPolicy, chat_examples

    rng = np.random.default_rng(0)
    spec = ArithSpec(n_train=max(data["short"], 1), min_follow_ups=0, max_follow_ups=1)
    short = arith_conversations(0, data["short"], split="train", spec=spec)
    corpus = load_corpus(DataConfig(source="stdlib"))
    files = [d for d in corpus.train if d.text.isascii() and len(d.text) > data["long_tokens"][1]]
    low, high = data["long_tokens"]
    long = []
    for k in range(data["long"]):
        document = files[int(rng.integers(len(files)))]
        size = int(rng.integers(low, high + 1))
        start = int(rng.integers(0, len(document.text) - size + 1))
        name = document.name.rsplit("/", 1)[-1]
        long.append(Conversation(messages=(
            Message("user", f"Show {size} characters of {name}."),
            Message("assistant", document.text[start : start + size])), name=f"stdlib:{k}"))
    mixed = [*short, *long]
    order = rng.permutation(len(mixed)).tolist()
    examples, _ = chat_examples([mixed[i] for i in order], ByteTokenizer(), ChatPolicy(),
                                max_len=data["seq_len"])
    return examples


def expected_targets(examples: list) -> int:
    """Targets of one pass, from the examples alone: each owned token but the first."""
    return sum(int(example.owned[1:].sum()) for example in examples)


# -------------------------------------------------------------------------- child side


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measure(spec: dict, check: bool = False) -> dict:
    """One pass of one side from a fresh model; its figures. ``check``: also report
    which parameters the pass changed (tests)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(spec["threads"])
    try:
        return measured(spec, check)
    finally:
        torch.set_num_threads(previous)


def measured(spec: dict, check: bool) -> dict:
    import torch

    from exactstep.artifacts.export import byte_tokenizer_hf
    from exactstep.bench.hf import ExactstepSide, TrainerSide, Workload, labelled_items, quiet_hf
    from exactstep.data.tokenizer import ByteTokenizer
    from exactstep.rows.config import BatchConfig
    from exactstep.rows.stream import RowStream

    import_rss = status_kib("VmRSS")
    data = spec["data"]
    tokenizer = ByteTokenizer()
    examples = finetune_examples(data)
    workload = Workload("sft", examples, labelled_items(examples), rows=data["rows"],
                        collator="seq2seq", seq_len=data["seq_len"])
    windows = sum(1 for _ in RowStream(examples, BatchConfig(seq_len=data["seq_len"],
                                                             rows=data["rows"]),
                                       pad_id=tokenizer.pad_id, seed=0, repeat=False,
                                       vocab_size=tokenizer.vocab_size))
    batch_size = max(1, round(len(workload.items) / windows))
    with quiet_hf(), tempfile.TemporaryDirectory() as out_dir:
        if spec["side"] == "exactstep":
            adapter = build_exactstep(spec, tokenizer.vocab_size)
            model = adapter.hf
            side: Any = ExactstepSide(adapter, model.state_dict(), workload, tokenizer.pad_id,
                                      tokenizer.vocab_size)
        else:
            model = build_trainer_model(spec, tokenizer.pad_id)
            side = TrainerSide(model, model.state_dict(), workload, byte_tokenizer_hf(tokenizer),
                               batch_size, out_dir)
            if spec["ac"]:
                side.trainer.args.gradient_checkpointing = True
                side.trainer.args.gradient_checkpointing_kwargs = {"use_reentrant": False}
        before = ({n: p.detach().clone() for n, p in model.named_parameters()} if check
                  else {})
        built_rss = status_kib("VmRSS")
        started = time.perf_counter()
        side()
        whole = time.perf_counter() - started
    peak = status_kib("VmHWM")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    result = {**side.last, "whole_pass_s": whole, "batch_size": batch_size, "windows": windows,
              "examples": len(examples), "import_rss_mib": import_rss / 1024,
              "built_rss_mib": built_rss / 1024, "peak_rss_mib": peak / 1024,
              "trainable_parameters": sum(p.numel() for p in model.parameters()
                                          if p.requires_grad),
              "trainable_tensors": len(trainable),
              "trainable_non_adapter": sum("lora_" not in n for n in trainable)}
    if check:
        result["changed"] = sorted(n for n, p in model.named_parameters()
                                   if not torch.equal(p.detach(), before[n]))
    return result


def build_exactstep(spec: dict, vocab_size: int) -> Any:
    """exactstep's model: ``build_hf_model`` from the config (probe included), LoRA and
    activation checkpointing through ``ModelConfig`` (H4, H5)."""
    from exactstep.model.config import LoRAConfig, ModelConfig
    from exactstep.model.hf import build_hf_model
    from exactstep.run.host_memory import pin_mmap_threshold

    pin_mmap_threshold()  # as every exactstep run does (runner.build_run, L1)
    lora = LoRAConfig(**spec["lora_config"]) if spec["lora"] else LoRAConfig()
    cfg = ModelConfig(source="hf", hf_config=dict(spec["model"]), attn_implementation="sdpa",
                      activation_checkpointing=spec["ac"], lora=lora)
    return build_hf_model(cfg, vocab_size, seed=0)


def build_trainer_model(spec: dict, pad_id: int) -> Any:
    """What a ``Trainer`` user builds: ``AutoModelForCausalLM.from_config`` (seeded),
    wrapped by ``peft.get_peft_model`` for LoRA with the same ``LoraConfig``."""
    import torch
    import transformers

    table = dict(spec["model"])
    config = transformers.AutoConfig.for_model(table.pop("model_type"), **table)
    config.pad_token_id = pad_id
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.config.use_cache = False
    if spec["lora"]:
        import peft

        lora = spec["lora_config"]
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
            target_modules=lora["target_modules"], bias="none", task_type="CAUSAL_LM"))
    return model


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
