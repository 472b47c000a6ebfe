"""At a large vocabulary no tensor of a training window or an evaluation grows with
rows x seq_len x V (L1, L5, E1): the built-in decoder and the HF adapter, end to end.

The measure is the largest tensor any aten op produces while a real ``UpdateEngine``
window (forward, backward, optimizer step) or ``evaluate`` runs, at V = 50,000 and
4 x 512 tokens. The full fp32 logits of that batch are ``4 * 512 * V * 4`` = 410 MB;
the bound is a quarter of that (102 MB). A chunk is capped at
``CHUNK_LOGIT_BYTES`` (64 MiB, 335 rows: 67 MB) and the parameters' largest tensor is
``V x 16`` (3.2 MB), so a chunked path stays under it; the full logits (4x the bound) and a
chunk sized by rows alone, the default 1024 rows (2x the bound), both exceed it,
which is the negative control.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from exactstep.eval import evaluate
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.objective import cross_entropy as ce_module
from exactstep.objective.config import ObjectiveConfig
from exactstep.rows.batch import Batch, Segment
from exactstep.update.config import NumericsConfig, UpdateConfig
from exactstep.update.groups import build_optimizer
from exactstep.update.precision import Precision
from exactstep.update.schedule import build_schedule
from exactstep.update.window import UpdateEngine

V, ROWS, T, PAD = 50_000, 4, 512, 0
FULL_LOGITS_BYTES = ROWS * T * V * 4
BOUND = FULL_LOGITS_BYTES // 4


class LargestTensor(TorchDispatchMode):
    """The largest tensor (bytes) any aten op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (ROWS, T), generator=g)
    labels = torch.randint(1, V, (ROWS, T), generator=g)
    return Batch(ids, labels, torch.arange(T).expand(ROWS, T).clone(),
                 torch.ones(ROWS, T, dtype=torch.int32),
                 tuple((Segment(i, 0, 0, 0, T),) for i in range(ROWS)))


def model_of(source: str) -> torch.nn.Module:
    if source == "builtin":
        cfg = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, tie_embeddings=True)
    else:
        cfg = ModelConfig(source="hf", attn_implementation="sdpa", hf_config={
            "model_type": "qwen2", "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": T, "tie_word_embeddings": True})
    return build_model(cfg, V, seed=0)


def largest_of_window_and_eval(model: torch.nn.Module) -> tuple[int, int]:
    cfg = UpdateConfig(schedule="constant", warmup=0, clip=1.0)
    optimizer, _ = build_optimizer(model, cfg)
    engine = UpdateEngine(model, optimizer, build_schedule(cfg, 10),
                          Precision(NumericsConfig(precision="fp32"), "cpu"), cfg,
                          ObjectiveConfig(), device="cpu", pad_id=PAD)
    with LargestTensor() as window:
        engine.run_window([batch(0)], 0)
    with LargestTensor() as held_out:
        result = evaluate(model, [batch(1)], device=torch.device("cpu"), max_tokens=ROWS * T,
                          pad_id=PAD)
    assert result.tokens == ROWS * T
    return window.largest, held_out.largest


@pytest.fixture(params=["builtin", "hf"])
def source(request) -> str:
    if request.param == "hf":
        pytest.importorskip("transformers")
    return request.param


def test_window_and_evaluation_hold_no_vocabulary_sized_tensor(source):
    window, held_out = largest_of_window_and_eval(model_of(source))
    assert window < BOUND, f"a training window produced a {window / 1e6:.0f} MB tensor"
    assert held_out < BOUND, f"evaluation produced a {held_out / 1e6:.0f} MB tensor"


def test_negative_control_chunks_sized_by_rows_alone_exceed_the_bound(monkeypatch):
    """The same measure with chunks of ``chunk_rows`` rows whatever V (no byte cap):
    the default 1024 rows at V = 50,000 is a 205 MB chunk."""
    monkeypatch.setattr(ce_module, "rows_per_chunk", lambda chunk_rows, vocab_size: chunk_rows)
    window, held_out = largest_of_window_and_eval(model_of("builtin"))
    assert window > BOUND and held_out > BOUND


def test_rows_per_chunk_caps_bytes_and_keeps_explicit_choices():
    cap = ce_module.CHUNK_LOGIT_BYTES
    assert ce_module.rows_per_chunk(1024, 151_936) * 151_936 * 4 <= cap
    assert ce_module.rows_per_chunk(1024, 259) == 1024  # small vocabularies: unchanged
    assert ce_module.rows_per_chunk(0, 151_936) == 0  # unchunked when asked for
    assert ce_module.rows_per_chunk(1024, cap) == 1  # at least one row


@pytest.mark.parametrize("lora", [False, True])
def test_export_logit_check_holds_no_document_sized_logits(monkeypatch, lora):
    """The handoff check (H3), and the adapter check through ``peft`` (H4), compare a document's logits chunk by chunk through
    transformers' ``logits_to_keep``. At V = 200,000 and T = 256 a document's fp32
    logits are 205 MB; the bound is half of that (102 MB: a chunk of at most half the
    document), a capped chunk is 83 rows (66 MB). Negative control: one chunk of all T
    positions (the unchunked comparison)."""
    pytest.importorskip("peft" if lora else "transformers")
    from exactstep.artifacts import export
    from exactstep.model.config import LoRAConfig

    vocab, length = 200_000, 256
    model = build_model(ModelConfig(source="hf", attn_implementation="sdpa", hf_config={
        "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": length, "tie_word_embeddings": True},
        lora=LoRAConfig(r=2 if lora else 0)), vocab, seed=0).eval()
    eager = None if lora else model.hf
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    bound = length * vocab * 4 // 2

    def largest() -> tuple[int, tuple[float, float]]:
        with torch.no_grad(), LargestTensor() as probe:
            diffs = export.logit_differences(model, model.hf, eager, ids)
        return probe.largest, diffs

    chunked, (diff, spread) = largest()
    assert chunked < bound, f"the export check produced a {chunked / 1e6:.0f} MB tensor"
    # the same weights on both sides, O(1) logits rounding to ~1e-7 (H3 holds 1e-5):
    # the value is a sanity check here, the memory bound the point
    assert diff < 1e-4 and spread == 0.0  # the same model on both sides
    monkeypatch.setattr(export, "rows_per_chunk", lambda chunk_rows, vocab_size: chunk_rows)
    whole, _ = largest()
    assert whole > bound
