"""``exactstep bench attention``: the figures it promises, never their values (timings).

The quick JSON holds every figure, the HF Llama side by side included: ``exactstep``
(what ``attn_implementation = "auto"`` resolved to) against ``sdpa`` at 1 thread, 2
threads and PyTorch's default, with the path ``model.attention = "auto"`` chose at
each. The HF rows are 16 x 256 tokens of documents of 16 to 128 tokens.
"""

from __future__ import annotations

import json
import math

import pytest

from exactstep.bench import attention as bench
from exactstep.cli import main

LABELS = ("1_thread", "2_threads", "default_threads")
HF_FIGURES = {"hf_documents", "hf_cross_document_fraction", "hf_auto_backend",
              *(f"hf_{what}_{label}" for label in LABELS for what in (
                  "exactstep_ms", "sdpa_ms", "exactstep_over_sdpa", "auto_choice"))}
QUICK_FIGURES = {
    "bench", "quick", "threads", "cross_document_fraction", "training_cross_document_fraction",
    *(f"{kind}_{rows}" for kind in ("speedup", "auto_speedup", "auto_choice")
      for rows in ("cross_document", "training_packed")),
    *(f"{kind}_cross_document_one_thread" for kind in ("speedup", "auto_speedup", "auto_choice")),
    "speedup_training_whole_rows", "tokens_per_s", "dense_tokens_per_s", "model_speedup",
    "parameters",
}


def test_the_hf_rows_hold_documents_of_16_to_128_tokens():
    lengths = bench.hf_lengths()
    assert len(lengths) == 16
    assert all(16 <= n <= 128 for row in lengths for n in row)
    assert all(sum(row) <= 256 for row in lengths)
    assert sum(map(len, lengths)) == 54


@pytest.mark.slow
def test_quick_json_has_every_figure_and_the_hf_side_by_side(capsys):
    pytest.importorskip("transformers")
    assert main(["bench", "attention", "--quick", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert set(figures) == QUICK_FIGURES | HF_FIGURES
    assert figures["hf_auto_backend"] == "exactstep"  # a Llama: auto is per document
    assert figures["hf_documents"] == 54
    for label in LABELS:
        assert figures[f"hf_auto_choice_{label}"] in {"segments", "dense"}
        for what in ("exactstep_ms", "sdpa_ms", "exactstep_over_sdpa"):
            value = figures[f"hf_{what}_{label}"]
            assert isinstance(value, float) and math.isfinite(value) and value > 0
