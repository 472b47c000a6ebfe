"""Cost of the whole window transaction against a plain hand-written loop (U1-U7).

``UpdateEngine.run_window`` and a hand-written forward / cross entropy / backward /
clip / AdamW loop train the same model on the same data, interleaved, in fp32 and
bf16; ``exactstep bench step`` reports tokens per second and ``time_ratio``.
Design and derivations: docs/design/bench.md#benchsteppy (U1-U7).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from exactstep.bench.common import interleaved_times, median
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import IGNORE_INDEX, Batch, Segment
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

VOCAB, PAD = 259, 258


def random_packed_batch(gen: torch.Generator, rows: int, seq_len: int, docs: int) -> Batch:
    """``rows`` rows, each ``docs`` documents of random length; last target of each ignored."""
    input_ids = torch.randint(0, 256, (rows, seq_len), generator=gen)  # [B, T]
    targets = torch.randint(0, 256, (rows, seq_len), generator=gen)  # [B, T]
    positions = torch.zeros(rows, seq_len, dtype=torch.long)
    segment_ids = torch.zeros(rows, seq_len, dtype=torch.int32)
    segments = []
    for b in range(rows):
        cuts = torch.randperm(seq_len - 1, generator=gen)[: docs - 1].add(1).sort().values
        bounds = [0, *cuts.tolist(), seq_len]
        row = []
        for k, (start, stop) in enumerate(zip(bounds, bounds[1:], strict=False)):
            positions[b, start:stop] = torch.arange(stop - start)
            segment_ids[b, start:stop] = k + 1
            targets[b, stop - 1] = IGNORE_INDEX  # no target across the boundary (R3)
            row.append(Segment(b * docs + k, 0, 0, start, stop - start))
        segments.append(tuple(row))
    return Batch(input_ids, targets, positions, segment_ids, tuple(segments))


def build_engine(model, precision: str) -> UpdateEngine:
    cfg = UpdateConfig(lr=1e-4, schedule="constant", warmup=0, clip=1.0)
    optimizer, _ = build_optimizer(model, cfg)
    return UpdateEngine(
        model,
        optimizer,
        build_schedule(cfg, 1000),
        Precision(NumericsConfig(precision=precision), "cpu"),
        cfg,
        ObjectiveConfig(),
        device="cpu",
        pad_id=PAD,
    )


def plain_loop(model, precision: str):
    """The hand-written baseline step for one batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if precision == "bf16"
        else contextlib.nullcontext
    )

    def step(batch: Batch) -> None:
        with autocast():
            logits = model.logits(model(batch))  # [B, T, V]
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), batch.labels.flatten(), ignore_index=IGNORE_INDEX
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(precision: str, models: tuple, batches: list[Batch], repeats: int) -> dict:
    """Interleaved timing of both steps over ``batches`` (one window per batch)."""
    engine = build_engine(models[0], precision)
    baseline_step = plain_loop(models[1], precision)
    counter = {"window": 0}

    def candidate() -> None:
        for batch in batches:
            engine.run_window([batch], counter["window"])
            counter["window"] += 1

    def baseline() -> None:
        for batch in batches:
            baseline_step(batch)

    cand, base = interleaved_times(candidate, baseline, repeats=repeats, warmup=1)
    tokens = sum(b.input_ids.numel() for b in batches)
    return {
        f"{precision}_time_ratio": median(cand) / median(base),
        f"{precision}_tokens_per_s": tokens / median(cand),
        f"{precision}_baseline_tokens_per_s": tokens / median(base),
    }


def run(quick: bool) -> dict:
    rows, seq_len, windows, repeats = (2, 64, 1, 2) if quick else (16, 256, 1, 7)
    gen = torch.Generator().manual_seed(0)
    batches = [random_packed_batch(gen, rows, seq_len, docs=4) for _ in range(windows)]
    cfg = ModelConfig()
    # identical initial weights; each precision gets a fresh optimizer on the same models
    models = (build_model(cfg, VOCAB, seed=0), build_model(cfg, VOCAB, seed=0))
    figures: dict = {"rows": rows, "seq_len": seq_len}
    for precision in ("fp32", "bf16"):
        figures.update(measure(precision, models, batches, repeats))
    figures["time_ratio"] = max(figures["fp32_time_ratio"], figures["bf16_time_ratio"])
    return figures


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
