"""``exactstep bench parallel --quick --json``: every layout against DDP, one object (D1, D4).

The bench runs at its tiny shape (two spawned gloo ranks per layout, a real
``build_run`` on each); the test reads the JSON the command prints. It checks the
keys, that every layout trained the same tokens as DDP (``tp2`` and ``pp2``, one
replica, with twice the microbatches a window), and the memory figures
against what the model's parameter count alone says each layout holds (fp32, AdamW:
two moments per parameter and one step count per tensor); it never reads a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from exactstep.bench import parallel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROW_KEYS = {"tokens", "tokens_per_s", "ms_per_window", "time_ratio", "memory_ratio",
            "optimizer_ratio", "rss_ratio", "peak_rss_mib", "param_bytes", "grad_bytes",
            "optimizer_bytes", "held_bytes", "parameters", "same_tokens_every_round"}


@pytest.fixture(scope="module")
def figures() -> dict:
    """The command as a user runs it; its stdout is one JSON object."""
    done = subprocess.run([sys.executable, "-m", "exactstep", "bench", "parallel", "--quick",
                           "--json"], capture_output=True, text=True, check=False, timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def shards_of(shape: tuple[str, ...]) -> dict:
    """What the quick shape's model holds, from its parameters' shapes: every
    parameter (DDP), and the larger rank's row shards (``torch.chunk`` on the first
    dimension, as FSDP2 shards), and how many tensors it has."""
    import torch

    from exactstep.config import load_config
    from exactstep.data.tokenizer import ByteTokenizer
    from exactstep.model.decoder import build_model

    cfg = load_config(None, [*parallel.COMMON, *shape])
    model = build_model(cfg.model, ByteTokenizer().vocab_size, seed=0)
    params = [p for p in model.parameters()]
    rows = [max(len(c) for c in torch.arange(p.shape[0]).chunk(2)) for p in params]
    return {"whole": sum(p.numel() for p in params),
            "shard": sum(r * p[0].numel() for r, p in zip(rows, params, strict=True)),
            "tensors": len(params)}


def test_one_object_names_the_cpu_and_every_layout(figures) -> None:
    assert figures["bench"] == "parallel" and figures["world_size"] == 2
    assert "unknown" not in figures["cpu"] and figures["cpu"].endswith("cores")
    assert figures["layouts"].split(",") == ["ddp", "fsdp", "zero1", "zero2", "tp2", "pp2"]
    (shape,) = parallel.QUICK_SHAPES
    rows = figures[shape]
    assert set(rows) == {"settings", *parallel.LAYOUTS}
    for name in parallel.LAYOUTS:
        assert set(rows[name]) == ROW_KEYS, name
    assert rows["ddp"]["time_ratio"] == rows["ddp"]["memory_ratio"] == 1.0


def test_every_layout_trained_the_same_tokens_as_ddp(figures) -> None:
    (shape,) = parallel.QUICK_SHAPES
    rows = figures[shape]
    tokens = rows["ddp"]["tokens"]
    assert tokens > 0
    assert all(rows[name]["tokens"] == tokens and rows[name]["same_tokens_every_round"]
               for name in parallel.LAYOUTS)


def test_memory_figures_are_what_each_layout_holds(figures) -> None:
    """fp32 AdamW: 4 bytes per parameter for weights and for gradients, 8 for the two
    moments, 4 for each tensor's step count; DDP holds all of it on every rank, zero1
    shards the state only, zero2 and fsdp shard weights, gradients and moments by
    rows (the larger rank's share), every rank keeping the step counts."""
    ((name, shape),) = parallel.QUICK_SHAPES.items()
    rows, held = figures[name], shards_of(shape)
    ddp = rows["ddp"]
    assert ddp["parameters"] == held["whole"]
    assert ddp["param_bytes"] == ddp["grad_bytes"] == 4 * held["whole"]
    assert ddp["optimizer_bytes"] == 8 * held["whole"] + 4 * held["tensors"]
    zero1 = rows["zero1"]
    assert zero1["param_bytes"] == zero1["grad_bytes"] == 4 * held["whole"]
    assert ddp["optimizer_bytes"] / 2 <= zero1["optimizer_bytes"] < ddp["optimizer_bytes"]
    for layout in ("zero2", "fsdp"):
        row = rows[layout]
        assert row["param_bytes"] == row["grad_bytes"] == 4 * held["shard"], layout
        assert row["optimizer_bytes"] == 8 * held["shard"] + 4 * held["tensors"], layout
    # tp2: each rank holds its tensor shards (the norms whole, the vocabulary padded)
    tp2 = rows["tp2"]
    assert 2 * held["shard"] <= tp2["param_bytes"] < ddp["param_bytes"]
    assert tp2["optimizer_bytes"] < ddp["optimizer_bytes"]
    # pp2: each rank holds its stage's layers (the larger stage's figures)
    pp2 = rows["pp2"]
    assert pp2["param_bytes"] == pp2["grad_bytes"] < ddp["param_bytes"]
    assert pp2["optimizer_bytes"] < ddp["optimizer_bytes"]
