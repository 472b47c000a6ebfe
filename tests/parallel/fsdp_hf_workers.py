"""One rank of the FSDP2 runs of a tiny HF Llama (and its LoRA variant), and the
one-process reference over the same global windows (D4, D5, H4).

A rank builds the model from a config (random init from the seed), shards it with
``shard_model`` (every decoder layer, then the root), runs its share of hand-made
windows with a multi-rank checkpoint after the first, and writes the gathered
parameters, its ledger and which modules FSDP2 holds as units; then fresh engines
continue from the checkpoint (everything restored, and weights only as the negative
control). The reference runs one process over every rank's microbatches.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import torch
from workers import (
    OBJECTIVE,
    PAD_ID,
    UPDATE,
    VOCAB,
    common_state,
    full_params,
    load_common,
    run_rank,
    stream_for,
)

from exactstep.model.config import LoRAConfig, ModelConfig
from exactstep.model.decoder import build_model
from exactstep.parallel.agreement import distribute_engine
from exactstep.parallel.config import ParallelConfig
from exactstep.parallel.dcp_format import load_distributed_checkpoint, save_distributed_checkpoint
from exactstep.parallel.wrap import shard_model
from exactstep.state.rng import capture_rng
from exactstep.update.config import NumericsConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

SAVED_AFTER = 1  # windows before the checkpoint
LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "vocab_size": VOCAB}


def hf_model_config(lora_r: int) -> ModelConfig:
    return ModelConfig(source="hf", hf_config=LLAMA, lora=LoRAConfig(r=lora_r, alpha=8.0))


def hf_engine(lora_r: int, lr: float, ctx=None, cfg: ParallelConfig | None = None
              ) -> UpdateEngine:
    """The engine over a tiny HF Llama (seed 3); sharded when ``ctx`` is distributed."""
    model = build_model(hf_model_config(lora_r), VOCAB, seed=3)
    if ctx is not None:
        model = shard_model(model, ctx, cfg)
    update = replace(UPDATE, lr=lr)
    optimizer, _ = build_optimizer(model, update)
    engine = UpdateEngine(model, optimizer, build_schedule(update, total_windows=100),
                          Precision(NumericsConfig(), "cpu"), update, OBJECTIVE,
                          device=torch.device("cpu"), pad_id=PAD_ID)
    return distribute_engine(engine, ctx, cfg) if ctx is not None else engine


def checkpoint_path(out: str | Path, lora_r: int) -> Path:
    return Path(out) / f"lora{lora_r}" / f"window-{SAVED_AFTER:08d}"


def windows_from(engine: UpdateEngine, windows, first: int) -> list[dict]:
    """Run ``windows`` as windows ``first, first + 1, ...``; their ledger records."""
    return [engine.run_window(list(batches), first + i).ledger_record()
            for i, batches in enumerate(windows)]


def fsdp_hf_main(rank: int, world: int, port: int, out: str, job: dict) -> None:
    """FSDP2 over gloo, once per LoRA rank in ``job['lora']`` (0: the whole model):
    straight with a checkpoint after ``SAVED_AFTER`` windows, resumed from it, and
    resumed from its weights alone (fresh optimizer: the negative control)."""
    from torch.distributed.fsdp import FSDPModule

    cfg = ParallelConfig(strategy="fsdp", timeout_s=60.0)

    def body(ctx, result: dict) -> None:
        mine = job["windows"][rank]
        for r in job["lora"]:
            engine = hf_engine(r, UPDATE.lr, ctx, cfg)
            units = [name for name, m in engine.model.named_modules()
                     if isinstance(m, FSDPModule)]
            ledger = windows_from(engine, mine[:SAVED_AFTER], 0)
            checkpoint, common = checkpoint_path(out, r), copy.deepcopy(common_state(engine))
            save_distributed_checkpoint(
                checkpoint.parent, checkpoint.name, model=engine.model,
                optimizer=engine.optimizer, common=common,
                rank_state={"rng": capture_rng(),
                            "data": stream_for(rank, world).state_dict()},
                ctx=ctx, keep=2)
            saved = full_params(engine)
            ledger += windows_from(engine, mine[SAVED_AFTER:], SAVED_AFTER)
            result[r] = {"params": full_params(engine), "ledger": ledger,
                         "units": units, "saved": saved}
            for name, optimizer in (("resumed", True), ("weights_only", False)):
                engine = hf_engine(r, UPDATE.lr, ctx, cfg)
                state = load_distributed_checkpoint(
                    checkpoint, model=engine.model,
                    optimizer=engine.optimizer if optimizer else None, ctx=ctx)
                load_common(engine, common if state is None else state.common)
                records = windows_from(engine, mine[SAVED_AFTER:], SAVED_AFTER)
                result[r][name] = {"params": full_params(engine),
                                   "ledger": ledger[:SAVED_AFTER] + records}

    run_rank(rank, world, port, out, cfg, body)
