"""Every host tensor reaches the device through the pinned, asynchronous copy (U7;
issue 16 item 5), checked on the CPU by recording the calls.

On CUDA ``host_to_device`` pins and copies with ``non_blocking=True`` (the CUDA test
``tests/test_cuda_paths.py`` counts the syncs); here the wiring is checked: the
window moves its batch, coefficients and row index through it, and every tensor of
a per-document or FlexAttention visibility is one that it returned.
"""

from __future__ import annotations

import warnings

import torch

from exactstep.bench.step import random_packed_batch
from exactstep.model import attention
from exactstep.model.attention import prepare_visibility
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows import transfer
from exactstep.update import window
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine


def recording(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` with a wrapper that records each result."""
    real, results = getattr(module, name), []

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        results.append(out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return results


def test_the_window_moves_batch_coefficients_and_index_through_the_pinned_copy(monkeypatch):
    batches = recording(monkeypatch, window, "batch_to_device")
    tensors = recording(monkeypatch, window, "host_to_device")
    cfg = UpdateConfig(warmup=0, schedule="constant")
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_ff=16), 259, seed=0)
    optimizer, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, 10),
                          Precision(NumericsConfig(), "cpu"), cfg, ObjectiveConfig(),
                          device="cpu", pad_id=258)
    batch = random_packed_batch(torch.Generator().manual_seed(0), 2, 16, docs=3)
    engine.run_window([batch, batch], 0)
    assert len(batches) == 2  # one batch per microbatch
    supervised = int((batch.labels != -100).sum())  # the plan indexes these rows (L1)
    # per microbatch: its coefficients [B, T], then its supervised-row index [n]
    assert [tuple(t.shape) for t in tensors] == [tuple(batch.labels.shape), (supervised,)] * 2


def test_every_tensor_of_a_visibility_comes_from_the_transfer(monkeypatch):
    moved = recording(monkeypatch, attention, "host_to_device")
    batch = random_packed_batch(torch.Generator().manual_seed(0), 2, 300, docs=3)
    for impl in ("segments", "flex"):
        moved.clear()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            vis = prepare_visibility(batch, impl, torch.device("cpu"))
        held = [vis.slot_of, vis.position_of, vis.position_or_none,
                *(b.key_mask for b in vis.buckets)]
        if vis.block_mask is not None:
            held += [getattr(vis.block_mask, name) for name in (
                "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")]
        held = [t for t in held if t is not None]
        assert held and all(any(t is m for m in moved) for t in held), impl


def test_off_cuda_the_transfer_is_a_plain_move() -> None:
    t = torch.arange(4)
    assert transfer.host_to_device(t, "cpu") is t  # no pinning without CUDA
