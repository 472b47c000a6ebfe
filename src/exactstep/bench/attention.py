"""Per-document attention vs one dense-mask SDPA, forward + backward, same run.

Both sides realise the same visibility (R2, R3); ``exactstep bench attention``
reports the speed-up on cross-document rows and at the default training shape
(packed and whole rows), and the decoder's ``tokens_per_s`` with ``auto`` attention.
Design and derivations: docs/design/bench.md#benchattentionpy (R2, R3).
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from exactstep.bench.common import interleaved_times, median
from exactstep.model.attention import attend_fused, prepare_visibility
from exactstep.model.config import ModelConfig
from exactstep.model.decoder import build_model
from exactstep.rows.batch import Batch, Segment

CPU = torch.device("cpu")


def packed_rows(rows: list[list[int]], seq_len: int, vocab: int = 259, seed: int = 0) -> Batch:
    """A causal batch whose row b holds documents of lengths ``rows[b]``, padded at the end."""
    g = torch.Generator().manual_seed(seed)
    B = len(rows)
    segment_ids = torch.zeros(B, seq_len, dtype=torch.int32)
    position_ids = torch.zeros(B, seq_len, dtype=torch.long)
    segments = []
    for b, lengths in enumerate(rows):
        col, row = 0, []
        for k, n in enumerate(lengths):
            segment_ids[b, col : col + n] = k + 1
            position_ids[b, col : col + n] = torch.arange(n)
            row.append(Segment(example_id=len(row), piece=0, offset=0, start=col, length=n))
            col += n
        segments.append(tuple(row))
    input_ids = torch.randint(0, vocab, (B, seq_len), generator=g)
    return Batch(
        input_ids=input_ids,
        labels=input_ids.clone(),
        position_ids=position_ids,
        segment_ids=segment_ids,
        segments=tuple(segments),
    )


def random_lengths(rng: random.Random, rows: int, seq_len: int, low: int, high: int) -> list:
    """Rows filled left to right with uniform lengths in [low, high] (the last one clipped)."""
    out = []
    for _ in range(rows):
        lengths, room = [], seq_len
        while room > 0:
            n = min(rng.randint(low, high), room)
            lengths.append(n)
            room -= n
        out.append(lengths)
    return out


def cross_document_fraction(rows: list[list[int]], seq_len: int) -> float:
    """Share of causal key-query pairs (j <= i) whose key is in another document."""
    causal_pairs = seq_len * (seq_len + 1) // 2
    within = [sum(n * (n + 1) // 2 for n in lengths) for lengths in rows]
    return 1.0 - sum(within) / (causal_pairs * len(rows))


def attention_speedup(batch: Batch, n_heads: int, head_dim: int, repeats: int) -> float:
    """Median dense time / median segments time, each call = prepare + forward + backward."""
    B, T = batch.shape
    g = torch.Generator().manual_seed(0)
    # The decoder's layout: rotated queries and keys, and values, in one tensor.
    qkv = torch.randn(B, T, 3, n_heads, head_dim, generator=g).requires_grad_()
    upstream = torch.randn(B, T, n_heads, head_dim, generator=g)

    def step(impl: str):
        def call() -> None:
            out = attend_fused(qkv, prepare_visibility(batch, impl, CPU))  # [B, T, nH, Dh]
            out.backward(upstream)

        return call

    seg, dense = interleaved_times(step("segments"), step("dense"), repeats=repeats)
    return median(dense) / median(seg)


def decoder_figures(batch: Batch, repeats: int) -> dict:
    """Forward + backward (with head and cross entropy) of the default decoder."""
    models = {
        impl: build_model(ModelConfig(attention=impl), 259, seed=0) for impl in ("auto", "dense")
    }

    def step(impl: str):
        model = models[impl]

        def call() -> None:
            logits = model.logits(model(batch))  # [B, T, V]
            F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten()).backward()
            model.zero_grad(set_to_none=True)

        return call

    auto, dense = interleaved_times(step("auto"), step("dense"), repeats=repeats)
    tokens = batch.input_ids.numel()
    return {
        "tokens_per_s": tokens / median(auto),
        "dense_tokens_per_s": tokens / median(dense),
        "model_speedup": median(dense) / median(auto),
        "parameters": models["auto"].num_parameters(),
    }


def run(quick: bool) -> dict:
    repeats = 3 if quick else 9
    rng = random.Random(0)
    # Cross-document rows: T=512, documents of 96..192 tokens (about 4 per row).
    cross_rows = random_lengths(rng, 8, 512, 96, 192)
    cross = packed_rows(cross_rows, 512)
    # Training shape: B=16, T=256; packed rows of 16..128-token documents, and rows
    # that are one document each (what splitting long documents produces).
    train_rows = random_lengths(rng, 16, 256, 16, 128)
    figures = {
        "cross_document_fraction": cross_document_fraction(cross_rows, 512),
        "speedup_cross_document": attention_speedup(cross, 4, 64, repeats),
        "training_cross_document_fraction": cross_document_fraction(train_rows, 256),
        "speedup_training_packed": attention_speedup(packed_rows(train_rows, 256), 4, 64, repeats),
        "speedup_training_whole_rows": attention_speedup(
            packed_rows([[256]] * 16, 256), 4, 64, repeats
        ),
    }
    figures.update(decoder_figures(packed_rows([[256]] * 16, 256), 1 if quick else 5))
    figures["threads"] = torch.get_num_threads()
    # The same cross-document comparison on one thread: on a shared, oversubscribed
    # machine every multi-threaded operator waits for a second core, which swamps
    # the compute saved; one thread measures the compute alone.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures["speedup_cross_document_one_thread"] = attention_speedup(cross, 4, 64, repeats)
    finally:
        torch.set_num_threads(threads)
    return figures


if __name__ == "__main__":
    from exactstep.bench.common import format_figures

    print(format_figures("attention", run(quick=True)))
