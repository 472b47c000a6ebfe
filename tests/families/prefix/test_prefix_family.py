"""The prefix LM family end to end (R8, U1, S5): exact accumulation over prefix
batches, a short run through ``exactstep train --set objective.family=prefix``
resumed bitwise, and greedy scoring that decodes with the training prefix.

Each promise has a negative control: a mean of microbatch means (U1), a resume
whose batches lose their prefixes (S5, and proof the run used them), and the
causal chat family's scoring, whose decoding rows carry no prefix.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from run_support import set_args

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.data.chat import DEFAULT_TEMPLATE
from exactstep.families import open_family, resolve
from exactstep.families.chat.family import chat_score
from exactstep.families.prefix import compiler as prefix_module
from exactstep.families.prefix.family import prefix_score
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective import plan_window
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import Batch
from exactstep.rows.stream import RowStream
from exactstep.state.compare import state_differences
from exactstep.state.safetensors_format import load_checkpoint
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.disposition import Outcome
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

SETTINGS = {
    "objective.family": "prefix",
    "seed": 3,
    "arith.n_train": 64,
    "arith.n_heldout": 4,
    "arith.max_new_tokens": 4,
    "train.device": "cpu",
    "batch.seq_len": 64,
    "batch.rows": 2,
    "model.d_model": 16,
    "model.n_layers": 2,  # with one layer a prefix changes no supervised row (see below)
    "model.n_heads": 2,
    "model.d_ff": 32,
    "update.accum": 2,
    "update.warmup": 2,
    "train.steps": 6,
    "train.eval_tokens": 64,
    "train.threads": 1,
    "checkpoint.every": 2,
    "checkpoint.keep": 3,
}


def prefix_parts():
    cfg = resolve(load_config(None, [f"{k}={v}" for k, v in SETTINGS.items()]))
    return cfg, open_family(cfg)


# ----------------------------------------------------------------------------- U1


def concat(batches: list[Batch]) -> Batch:
    """One batch holding every row of ``batches`` (same columns), prefixes included."""
    width = max(b.prefix_len.shape[1] for b in batches)
    prefix = torch.cat([torch.nn.functional.pad(b.prefix_len, (0, width - b.prefix_len.shape[1]))
                        for b in batches])
    return Batch(*(torch.cat([getattr(b, name) for b in batches]) for name in
                   ("input_ids", "labels", "position_ids", "segment_ids")),
                 segments=tuple(row for b in batches for row in b.segments), prefix_len=prefix)


def mean_of_means(batches, cfg):
    """WRONG (U1): each microbatch's own token mean, divided by K."""
    plan = plan_window(batches, cfg)
    k = len(batches)
    coefficients = [c / max(1.0, float(c.sum())) / k for c in plan.coefficients]
    return type(plan)(coefficients, 1.0, plan.tokens, [1.0] * k, plan.row_indices,
                      plan.microbatch_tokens)


def one_update(batches: list[Batch], vocab: int, *, plan=None) -> list[torch.Tensor]:
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=2, d_ff=32), vocab, seed=4)
    cfg = UpdateConfig(optimizer="sgd", lr=1.0, momentum=0.0, clip=0.0, weight_decay=0.0,
                       schedule="constant", warmup=0, accum=len(batches))
    optimizer, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, 10),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(), device="cpu", pad_id=0)
    if plan is not None:
        engine.plan = plan
    assert engine.run_window(batches, 0).outcome is Outcome.COMMITTED
    return [p.detach().clone() for p in engine.parameters]


def test_prefix_microbatches_equal_one_batch_u1():
    cfg, parts = prefix_parts()
    batches = []
    for rows in (1, 3, 2):  # packed rows of several conversations, unequal microbatches
        shape = replace(cfg.batch, rows=rows, seq_len=160)
        batches.append(next(iter(RowStream(parts.data.train, shape, seed=rows,
                                           pad_id=parts.tokenizer.pad_id,
                                           compiler=parts.compiler))))
    assert all(b.prefix_len is not None and int(b.prefix_len.max()) > 1 for b in batches)
    assert len({b.num_targets() for b in batches}) > 1  # unequal microbatches
    vocab = parts.tokenizer.vocab_size
    whole = one_update([concat(batches)], vocab)

    def error(split):
        return max(float((a - b).abs().max()) for a, b in zip(split, whole, strict=True))

    # U1's fp32 1e-5: SGD (lr 1) moves each parameter by its gradient, whose split and whole
    # forms differ in summation order only (~1e-7 on these O(1) tiny models), two orders below
    assert error(one_update(batches, vocab)) <= 1e-5
    assert error(one_update(batches, vocab, plan=mean_of_means)) > 1e-5


# ----------------------------------------------------------------------------- S5


def train(run_dir: Path) -> None:
    assert main(["train", "--no-progress", "--out", str(run_dir), *set_args(SETTINGS)]) == 0


def final_state(run_dir: Path) -> dict:
    model, parts = load_checkpoint(run_dir / "checkpoints" / "window-00000006")
    return {"model": model, **parts}


def resume_from_window_2(straight: Path, run_dir: Path) -> None:
    shutil.copytree(straight, run_dir)
    for name in ("window-00000004", "window-00000006"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    start = run_dir / "checkpoints" / "window-00000002"
    assert main(["resume", "--no-progress", str(run_dir), "--from", str(start)]) == 0


@pytest.mark.slow
def test_a_prefix_run_resumes_bitwise_s5(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(straight)
    manifest = json.loads((straight / "manifest.json").read_text())
    assert manifest["manifest"]["objective"]["family"] == "prefix_lm"
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["exact_match_n"] == 4 and 0.0 <= summary["exact_match"] <= 1.0

    resumed = tmp_path / "resumed"
    resume_from_window_2(straight, resumed)
    assert state_differences(final_state(straight), final_state(resumed)) == []
    assert (straight / "ledger.jsonl").read_bytes() == (resumed / "ledger.jsonl").read_bytes()

    # negative control: batches whose prefixes are dropped (causal rows) after the
    # resume must end elsewhere, so the run above trained with its prefixes
    compile_prefix = prefix_module.compile_prefix_batch

    def causal_rows(*args, **kwargs):
        batch = compile_prefix(*args, **kwargs)
        return replace(batch, prefix_len=torch.zeros_like(batch.prefix_len))

    monkeypatch.setattr(prefix_module, "compile_prefix_batch", causal_rows)
    dropped = tmp_path / "dropped"
    resume_from_window_2(straight, dropped)
    assert any(d.startswith("model.") for d in state_differences(final_state(straight),
                                                                 final_state(dropped)))


# ----------------------------------------------------------------------------- scoring


class Recorder(torch.nn.Module):
    """The model, recording every batch greedy decoding hands it."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.seen: list[Batch] = []

    def forward(self, batch: Batch) -> torch.Tensor:
        self.seen.append(batch)
        return self.model(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)


def decoding_prefixes_match_training(score) -> bool:
    """Every decoding row's prefix is its conversation's first prompt (the question and
    the assistant header, rendered by the template alone): training's prefix."""
    cfg, parts = prefix_parts()
    recorder = Recorder(parts.family.build_model(cfg, parts.tokenizer.vocab_size))
    result = score(recorder, parts, cfg, "cpu")
    assert result["exact_match_n"] == 4
    expected = {}
    for conversation in parts.data.heldout_conversations:
        prompt = DEFAULT_TEMPLATE.render_prompt(conversation.messages[:-1], parts.tokenizer)
        first = DEFAULT_TEMPLATE.render_prompt(conversation.messages[:1], parts.tokenizer)
        expected[tuple(prompt.tokens.tolist())] = len(first.tokens)
    firsts = [b for b in recorder.seen if tuple(b.input_ids[0].tolist()) in expected]
    assert len(firsts) >= 1
    for batch in firsts:
        if batch.prefix_len is None:
            return False
        for row, prefix in zip(batch.input_ids.tolist(), batch.prefix_len[:, 0].tolist(),
                               strict=True):
            if expected[tuple(row)] != prefix:
                return False
    return all(b.prefix_len is not None for b in recorder.seen)


def test_prefix_scoring_decodes_with_the_training_prefix():
    assert decoding_prefixes_match_training(prefix_score)
    assert not decoding_prefixes_match_training(chat_score)  # causal decoding: no prefix
