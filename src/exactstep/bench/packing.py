"""Packing plan: efficiency and throughput of best-fit-decreasing rows (R4).

``RowStream``'s best-fit-decreasing plan and a sequential next-fit baseline pack the
same documents through the same causal compiler; ``exactstep bench packing`` reports
the efficiency and tokens per second of each and their time ratio per token.
Design and derivations: docs/design/bench.md#benchpackingpy (R4).
"""

from __future__ import annotations

import numpy as np

from exactstep.bench.common import interleaved_times, median
from exactstep.rows.causal import compile_causal_batch
from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.invariants import check_batch
from exactstep.rows.packing import Piece, cut_example
from exactstep.rows.stream import RowStream

SEQ_LEN = 2048
ROWS = 8
PAD, VOCAB = 258, 259


def synthetic_examples(distribution: str, n: int, seed: int) -> list[Example]:
    """Random byte documents whose lengths follow ``distribution`` (mean ~ SEQ_LEN / 4)."""
    rng = np.random.default_rng(seed)
    if distribution == "gamma":
        lengths = rng.gamma(2.0, SEQ_LEN / 8, size=n)
    else:
        lengths = rng.lognormal(np.log(SEQ_LEN / 6), 1.0, size=n)
    lengths = np.maximum(2, lengths.astype(np.int64))
    tokens = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [Example(i, tokens[bounds[i] : bounds[i + 1]]) for i in range(n)]


def pack_bfd(examples: list[Example], cfg: BatchConfig) -> tuple[int, int]:
    stream = RowStream(examples, cfg, pad_id=PAD, seed=0, repeat=False, vocab_size=VOCAB)
    for _ in stream:
        pass
    report = stream.report()
    return report["real_tokens"], report["slots"]


def pack_next_fit(examples: list[Example], cfg: BatchConfig) -> tuple[int, int]:
    """The baseline: sequential next-fit, same cut rule, same compiler and checks."""
    rows: list[list[Piece]] = []
    real = slots = 0
    row: list[Piece] = []
    space = cfg.seq_len
    for index, example in enumerate(examples):
        runs, _ = cut_example(example, cfg.seq_len, cfg.overlong, overlap_split=False)
        for k, (offset, length) in enumerate(runs):
            if length > space:
                rows.append(row)
                row, space = [], cfg.seq_len
            row.append(Piece(index, offset, length, k))
            space -= length
            real += length
            if len(rows) == cfg.rows:
                emit(rows, examples, cfg)
                slots += len(rows) * cfg.seq_len
                rows = []
    rows.append(row)
    emit(rows, examples, cfg)
    slots += len(rows) * cfg.seq_len
    return real, slots


def emit(rows: list[list[Piece]], examples: list[Example], cfg: BatchConfig) -> None:
    batch = compile_causal_batch(rows, examples, seq_len=cfg.seq_len, pad_id=PAD)
    check_batch(batch, VOCAB, cfg.boundary, next_token_targets=True)


def run(quick: bool) -> dict:
    n_docs = 2_000 if quick else 12_000
    repeats = 2 if quick else 4
    cfg = BatchConfig(seq_len=SEQ_LEN, rows=ROWS, buffer=512)
    figures: dict = {"seq_len": SEQ_LEN, "documents": n_docs}
    for distribution in ("gamma", "lognormal"):
        examples = synthetic_examples(distribution, n_docs, seed=0)
        real, slots = pack_bfd(examples, cfg)
        base_real, base_slots = pack_next_fit(examples, cfg)
        cand_t, base_t = interleaved_times(
            lambda ex=examples: pack_bfd(ex, cfg),
            lambda ex=examples: pack_next_fit(ex, cfg),
            repeats=repeats,
            warmup=0,
        )
        figures[f"{distribution}_efficiency"] = real / slots
        figures[f"{distribution}_baseline_efficiency"] = base_real / base_slots
        figures[f"{distribution}_tokens_per_s"] = real / median(cand_t)
        figures[f"{distribution}_baseline_tokens_per_s"] = base_real / median(base_t)
        figures[f"{distribution}_time_ratio"] = median(cand_t) / median(base_t)
    figures["efficiency"] = min(figures["gamma_efficiency"], figures["lognormal_efficiency"])
    figures["tokens_per_s"] = min(figures["gamma_tokens_per_s"], figures["lognormal_tokens_per_s"])
    return figures


if __name__ == "__main__":
    from exactstep.bench.common import format_figures

    print(format_figures("packing", run(quick=True)))
