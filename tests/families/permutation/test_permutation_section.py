"""The run's ``[permutation]`` section is the cutoff its batches are compiled with (R8, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family``) a run configured with ``predict_one_in = 3`` (XLNet's default: 6)
compiles its training stream with it: in every segment of many compiled batches the
predicted columns are exactly ``min(ceil(F / 3), L - 1)`` of its ``L`` columns, ``F``
its free tokens (every token but its example's first, counted here from the segment's
offset), and they are the last of the segment's factorisation order (its highest
ranks). The manifest records ``predict_one_in = 3``.

``test_permutation_run`` trains such a run and bounds the supervised fraction loosely
(more than a quarter of the tokens); this is the exact, per-segment statement.
Negative control: the glue planted so that its compiler gets the section's default
(``PermutationConfig().predict_one_in``) instead of ``cfg.permutation``; the same
check then reports violations, while the manifest section still says 3.
"""

from __future__ import annotations

import math

from text_corpus import write_corpus

import exactstep.families.permutation.family as permutation_family
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.permutation.compiler import PermutationCompiler
from exactstep.families.permutation.config import PermutationConfig
from exactstep.rows.stream import RowStream

K = 3
BATCHES = 20  # 20 batches of 4 x 128 columns: every training document, twice
IGNORE_INDEX = -100


def configured(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    overrides = {"objective.family": "permutation", "data.source": corpus,
                 "data.val_fraction": 0.1, "batch.seq_len": 128, "batch.rows": 4,
                 "permutation.predict_one_in": K}
    return resolve(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))


def training_batches(cfg) -> list:
    """The first ``BATCHES`` batches of the run's training stream, as the runner builds
    it from ``open_family``'s parts."""
    parts = open_family(cfg)
    stream = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                       seed=cfg.seed, vocab_size=parts.tokenizer.vocab_size,
                       compiler=parts.compiler)
    return [stream.next_batch() for _ in range(BATCHES)]


def violations(batches) -> list[str]:
    """Segments whose predicted columns are not the cutoff's count, or not the last of
    their order (each kind once, with how many segments show it)."""
    counts = {"count": 0, "order": 0}
    segments = predicted = real = 0
    for batch in batches:
        labels, ranks = batch.labels.tolist(), batch.order.tolist()
        for b, row in enumerate(batch.segments):
            for seg in row:
                cols = range(seg.start, seg.stop)
                free = seg.length - (seg.offset == 0)  # an example's first token is context
                want = max(0, min(math.ceil(free / K), seg.length - 1))
                chosen = [c for c in cols if labels[b][c] != IGNORE_INDEX]
                counts["count"] += len(chosen) != want
                top = sorted(cols, key=lambda c: ranks[b][c])[seg.length - len(chosen):]
                counts["order"] += sorted(chosen) != sorted(top)
                segments, predicted, real = segments + 1, predicted + len(chosen), real + seg.length
    assert segments > 100  # the check saw many segments
    return [f"{n} of {segments} segments: the predicted columns are not "
            + ("min(ceil(free / 3), length - 1)" if kind == "count" else "the order's last")
            + f" ({predicted} of {real} tokens predicted)" for kind, n in counts.items() if n]


def test_the_run_predicts_one_token_in_the_configured_k(tmp_path):
    cfg = configured(tmp_path)
    assert cfg.permutation.predict_one_in == K
    assert violations(training_batches(cfg)) == []
    assert permutation_family.FAMILY.objective(cfg)["predict_one_in"] == K


def test_negative_control_a_glue_built_from_the_default_is_caught(tmp_path, monkeypatch):
    def from_defaults(*, seed, predict_one_in):
        return PermutationCompiler(seed=seed,
                                   predict_one_in=PermutationConfig().predict_one_in)

    monkeypatch.setattr(permutation_family, "PermutationCompiler", from_defaults)
    cfg = configured(tmp_path)
    found = violations(training_batches(cfg))
    assert any("min(ceil(free / 3)" in v for v in found), found
    assert permutation_family.FAMILY.objective(cfg)["predict_one_in"] == K  # still says so
