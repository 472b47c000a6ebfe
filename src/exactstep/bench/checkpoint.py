"""Checkpoint save and load of a full training state against plain torch.save/torch.load.

The candidate is exactstep's atomic publication and verified load (S3, S6); the
baseline one ``torch.save`` file and ``torch.load(weights_only=True)``, alternating in
one process. ``exactstep bench checkpoint`` reports save and load time ratios.
Design and derivations: docs/design/bench.md#benchcheckpointpy (S3, S6).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from exactstep.bench.common import interleaved_times, median
from exactstep.state.rng import capture_rng
from exactstep.state.safetensors_format import load_checkpoint, publish_checkpoint


def build_state(d_model: int, n_layers: int, vocab: int) -> tuple[dict[str, torch.Tensor], dict]:
    """A decoder-shaped model state and the parts a trainer checkpoints (S2)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Embedding(vocab, d_model)]
    for _ in range(n_layers):
        layers += [
            torch.nn.Linear(d_model, 3 * d_model, bias=False),
            torch.nn.Linear(d_model, d_model, bias=False),
            torch.nn.Linear(d_model, 4 * d_model, bias=False),
            torch.nn.Linear(4 * d_model, d_model, bias=False),
            torch.nn.LayerNorm(d_model),
        ]
    head = torch.nn.Linear(d_model, vocab, bias=False)
    head.weight = layers[0].weight  # tied, like the built-in decoder
    model = torch.nn.Sequential(*layers, head)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    parts = {
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "scaler": {},
        "progress": {"next_window": 1, "ledger_position": 1, "manifest_digest": "0" * 64},
        "rng": capture_rng(),
        "data": {"epoch": 0, "cursor": 123, "pending": [[1, 2, 3, 4, 5]]},
    }
    return dict(model.state_dict()), parts


def state_bytes(model_state: dict[str, torch.Tensor], parts: dict) -> int:
    seen: set[int] = set()
    total = 0

    def visit(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            key = x.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(model_state)
    visit(parts)
    return total


def run(quick: bool) -> dict:
    d_model, n_layers, vocab = (256, 4, 4096) if quick else (512, 8, 16384)
    repeats = 3 if quick else 7
    model_state, parts = build_state(d_model, n_layers, vocab)
    workdir = Path(tempfile.mkdtemp(prefix="exactstep-bench-ckpt-"))
    try:
        root = workdir / "checkpoints"
        plain = workdir / "plain.pt"
        counter = iter(range(10**9))

        def save_candidate() -> None:
            publish_checkpoint(root, f"s{next(counter):06d}", model_state, parts, keep=1)

        def save_baseline() -> None:
            torch.save({"model": model_state, **parts}, plain)

        def save_baseline_durable() -> None:
            with open(plain, "wb") as fh:
                torch.save({"model": model_state, **parts}, fh)
                fh.flush()
                os.fsync(fh.fileno())

        save_c, save_b = interleaved_times(save_candidate, save_baseline, repeats=repeats)
        save_c2, save_d = interleaved_times(save_candidate, save_baseline_durable, repeats=repeats)
        latest = sorted(p for p in root.iterdir() if not p.name.startswith((".", "LATEST")))[-1]

        def load_verified() -> None:
            load_checkpoint(latest, verify=True)

        def load_unverified() -> None:
            load_checkpoint(latest, verify=False)

        def load_baseline() -> None:
            torch.load(plain, weights_only=True)

        load_c, load_b = interleaved_times(load_verified, load_baseline, repeats=repeats)
        load_u, load_b2 = interleaved_times(load_unverified, load_baseline, repeats=repeats)
        size = state_bytes(model_state, parts)
        return {
            "state_mb": size / 2**20,
            "save_time_ratio": median(save_c) / median(save_b),
            "save_time_ratio_vs_fsynced_torch_save": median(save_c2) / median(save_d),
            "load_time_ratio": median(load_c) / median(load_b),
            "load_unverified_time_ratio": median(load_u) / median(load_b2),
            "save_mb_per_s": size / 2**20 / median(save_c),
            "load_mb_per_s": size / 2**20 / median(load_c),
            "baseline_save_s": median(save_b),
            "baseline_load_s": median(load_b),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
