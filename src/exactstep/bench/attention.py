"""Per-document attention and ``auto`` vs one dense-mask SDPA, forward + backward.

All sides realise the same visibility (R2, R3); ``exactstep bench attention``
reports the speed-ups at PyTorch's default thread count, and on one thread, on
cross-document rows and at the default training shape (packed and whole rows), and
the decoder's ``tokens_per_s`` with ``auto`` attention; and, for an HF Llama at that
training shape, ``attn_implementation = "exactstep"`` (``model.attention = "auto"``)
against ``sdpa``'s dense block mask at 1 and 2 threads (``hf_figures``). ``python -m
exactstep.bench.attention --calibrate`` measures the cost model behind ``auto``.
Design and derivations: docs/design/bench.md#benchattentionpy,
docs/design/model.md#auto-on-cpu (R2, R3).
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from exactstep.bench.common import interleaved_times, median
from exactstep.errors import ModelError
from exactstep.model.attention import (
    attend_fused,
    auto_costs,
    prepare_visibility,
    resolve_impl,
)
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


def attention_speedup(batch: Batch, n_heads: int, head_dim: int, repeats: int,
                      sides: tuple[str, ...] = ("dense", "segments", "auto")) -> dict:
    """Median dense time over the median time of each other side in ``sides`` (each
    call = prepare + forward + backward, the sides interleaved), and what auto chose."""
    times = side_times(batch, n_heads, head_dim, repeats, sides)
    return {**{side: times["dense"] / times[side] for side in sides if side != "dense"},
            "auto_choice": resolve_impl("auto", CPU, batch=batch)}


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
    """Figures at PyTorch's default thread count (a run with ``train.threads = 0``),
    then the attention figures again on one thread."""
    repeats = 3 if quick else 9
    rng = random.Random(0)
    # Cross-document rows: T=512, documents of 96..192 tokens (about 4 per row).
    cross_rows = random_lengths(rng, 8, 512, 96, 192)
    cross = packed_rows(cross_rows, 512)
    # Training shape: B=16, T=256; packed rows of 16..128-token documents, and rows
    # that are one document each (what splitting long documents produces).
    train_rows = random_lengths(rng, 16, 256, 16, 128)
    packed = packed_rows(train_rows, 256)
    figures: dict = {
        "threads": torch.get_num_threads(),
        "cross_document_fraction": cross_document_fraction(cross_rows, 512),
        "training_cross_document_fraction": cross_document_fraction(train_rows, 256),
    }

    def attention_figures(suffix: str, cases) -> None:
        for name, batch in cases:
            sides = attention_speedup(batch, 4, 64, repeats)
            figures[f"speedup_{name}{suffix}"] = sides["segments"]
            figures[f"auto_speedup_{name}{suffix}"] = sides["auto"]
            figures[f"auto_choice_{name}{suffix}"] = sides["auto_choice"]

    cases = (("cross_document", cross), ("training_packed", packed))
    attention_figures("", cases)
    figures["speedup_training_whole_rows"] = attention_speedup(  # auto = segments here
        packed_rows([[256]] * 16, 256), 4, 64, repeats, ("dense", "auto"))["auto"]
    figures.update(decoder_figures(packed_rows([[256]] * 16, 256), 1 if quick else 5))
    if not quick:
        figures["packed_model_speedup"] = decoder_figures(packed, 5)["model_speedup"]
    figures.update(hf_figures(2 if quick else 7))
    # The same comparisons on one thread: no operator waits for a second core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        attention_figures("_one_thread", cases[:1] if quick else cases)
    finally:
        torch.set_num_threads(threads)
    return figures


#: the HF Llama of the side-by-side figures (hidden 128, 4 layers, 4 heads)
HF_LLAMA = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 344,
            "max_position_embeddings": 256}
HF_THREADS = (1, 2)  # the thread counts measured, besides PyTorch's default


def hf_lengths(rows: int = 16, seq_len: int = 256, seed: int = 0) -> list[list[int]]:
    """Documents of 16..128 tokens per row while they fit, the tail padding (16 rows
    of 256: 54 documents)."""
    g, lengths = torch.Generator().manual_seed(seed), []
    for _ in range(rows):
        row: list[int] = []
        while sum(row) + (n := int(torch.randint(16, 129, (1,), generator=g))) <= seq_len:
            row.append(n)
        lengths.append(row)
    return lengths


def hf_figures(repeats: int) -> dict:
    """An HF Llama (``HF_LLAMA``), forward + backward of its decoder on 16 x 256 tokens
    of ``hf_lengths``: ``attn_implementation = "auto"`` (which resolves to
    ``exactstep`` for it) under ``model.attention = "auto"`` against ``sdpa`` with the
    dense block mask, the same weights, interleaved, median of ``repeats``. Per thread
    count (1, 2, and PyTorch's default as ``default_threads``): both medians in ms,
    the ratio ``exactstep / sdpa`` (below 1: exactstep is faster) and the path
    ``auto`` chose. Without the HF extra, one figure says so."""
    from exactstep.model.hf import build_hf_model, import_transformers

    try:
        import_transformers()
    except ModelError as exc:
        return {"hf": f"not measured: {exc}"}
    lengths = hf_lengths()
    batch = packed_rows(lengths, 256, vocab=512)
    models = {attn: build_hf_model(ModelConfig(source="hf", hf_config=HF_LLAMA,
                                               attn_implementation=attn), 512, seed=0)
              for attn in ("auto", "sdpa")}

    def step(attn: str):
        model = models[attn]

        def call() -> None:
            model.zero_grad(set_to_none=True)
            model(batch).square().mean().backward()

        return call

    default = torch.get_num_threads()
    figures: dict = {"hf_documents": sum(map(len, lengths)),
                     "hf_cross_document_fraction": cross_document_fraction(lengths, 256),
                     "hf_auto_backend": models["auto"].attn_implementation}
    measured: dict[int, tuple[float, float, str]] = {}
    try:
        for t in dict.fromkeys((*HF_THREADS, default)):
            torch.set_num_threads(t)
            ours, dense = interleaved_times(step("auto"), step("sdpa"), repeats=repeats)
            measured[t] = (median(ours), median(dense),
                           resolve_impl("auto", CPU, batch=batch, threads=t))
    finally:
        torch.set_num_threads(default)
    labels = [(f"{t}_thread" if t == 1 else f"{t}_threads", t) for t in HF_THREADS]
    for label, t in [*labels, ("default_threads", default)]:
        ours, dense, choice = measured[t]
        figures[f"hf_exactstep_ms_{label}"] = round(1e3 * ours, 1)
        figures[f"hf_sdpa_ms_{label}"] = round(1e3 * dense, 1)
        figures[f"hf_exactstep_over_sdpa_{label}"] = ours / dense
        figures[f"hf_auto_choice_{label}"] = choice
    return figures


CALIBRATION_LAYOUTS = ((1, 8), (8, 32), (16, 128), (8, 2), (4, 1))  # (low, high) or T/low..T/high


def calibration_cases(seed: int = 0) -> list[tuple[str, Batch]]:
    """Packed rows at B x T = 16 x 256 and 8 x 1024: uniform document lengths in
    [1, 8], [8, 32], [16, 128], [T/8, T/2] and [T/4, T] (the last one clipped)."""
    rng = random.Random(seed)
    cases = []
    for B, T in ((16, 256), (8, 1024)):
        for a, b in CALIBRATION_LAYOUTS:
            low, high = (a, b) if a < b else (T // a, T // b)
            name = f"{B}x{T} docs {low}..{high}"
            cases.append((name, packed_rows(random_lengths(rng, B, T, low, high), T)))
    return cases


def calibrate(threads: tuple[int, ...] = (1, 2), repeats: int = 7) -> list[dict]:
    """Dense, per-document (its one-thread buckets) and auto attention (prepare +
    forward + backward), median of ``repeats`` interleaved calls, for every
    calibration case, width (d_model 128 with 4 heads, 512 with 8) and thread count,
    with the cost model's figures and auto's choice at that count."""
    saved, rows = torch.get_num_threads(), []
    try:
        for name, batch in calibration_cases():
            for n_heads, head_dim in ((4, 32), (8, 64)):
                for t in threads:
                    torch.set_num_threads(t)
                    times = side_times(batch, n_heads, head_dim, repeats,
                                       ("dense", "segments", "auto"))
                    rows.append({"case": name, "d_model": n_heads * head_dim, "threads": t,
                                 **auto_costs(batch, t),
                                 "auto_choice": resolve_impl("auto", CPU, batch=batch),
                                 **{f"{k}_ms": round(1e3 * v, 2) for k, v in times.items()}})
    finally:
        torch.set_num_threads(saved)
    return rows


def side_times(batch: Batch, n_heads: int, head_dim: int, repeats: int, impls) -> dict:
    """Median seconds of each implementation in ``impls``, calls interleaved."""
    B, T = batch.shape
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, 3, n_heads, head_dim, generator=g).requires_grad_()
    upstream = torch.randn(B, T, n_heads, head_dim, generator=g)

    def call(impl: str) -> None:
        out = attend_fused(qkv, prepare_visibility(batch, impl, CPU))  # [B, T, nH, Dh]
        out.backward(upstream)
        qkv.grad = None

    for impl in impls:  # warm-up
        call(impl)
    seconds = {impl: [] for impl in impls}
    for r in range(repeats):
        for impl in impls if r % 2 == 0 else impls[::-1]:
            t0 = time.perf_counter()
            call(impl)
            seconds[impl].append(time.perf_counter() - t0)
    return {impl: median(s) for impl, s in seconds.items()}


if __name__ == "__main__":
    import json
    import sys

    from exactstep.bench.common import format_figures

    if sys.argv[1:2] == ["--calibrate"]:  # the measurement behind model.attention's auto choice
        for row in calibrate():
            print(json.dumps(row), flush=True)
    else:
        print(format_figures("attention", run(quick=True)))
