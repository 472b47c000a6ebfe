"""The end-of-run reconstruction scores of the denoising families (R9, E1).

``edit_accuracy`` against hand-counted edits and a brute-force edit distance; a MASS
and a BART run's ``summary.json`` hold their reconstruction and the copy baseline, the
copy baseline recomputed here from the compiler's own held-out pieces (an independent
path: the metric over the noised inputs, not the score function); greedy fragments
from ``<mask>`` equal an argmax loop written here.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from run_support import set_args

from exactstep.cli import main
from exactstep.config import load_config
from exactstep.eval import edit_accuracy, heldout_pieces, levenshtein
from exactstep.families import open_family
from exactstep.model.encdec import greedy_fragments
from exactstep.rows.batch import single_segment_batch, source_rows
from exactstep.run.finished_run import open_finished_run

TINY = {"batch.seq_len": 48, "batch.rows": 2, "model.d_model": 16, "model.n_layers": 1,
        "model.n_heads": 2, "model.d_ff": 32, "train.steps": 3, "train.eval_tokens": 256,
        "train.threads": 1, "data.max_docs": 60, "data.val_fraction": 0.2}


def brute(a: tuple, b: tuple) -> int:
    @functools.cache
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_edit_accuracy_by_hand():
    assert levenshtein([1, 2, 3], [1, 2, 3]) == 0
    assert levenshtein([1, 3], [1, 2, 3]) == 1  # one insertion
    assert levenshtein([9, 9, 9], [1, 2]) == 3
    assert edit_accuracy([[1, 2, 3], [5]], [[1, 2, 3], [6, 7]]) == pytest.approx(1 - 2 / 5)
    assert edit_accuracy([[]], [[]]) is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=8))
def test_levenshtein_is_the_edit_distance(a, b):
    assert levenshtein(a, b) == brute(tuple(a), tuple(b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny MASS and a tiny BART run (three windows each)."""
    out = {}
    for family in ("mass", "bart"):
        run = tmp_path_factory.mktemp(family) / "run"
        assert main(["train", "--no-progress", "--config", config_of(family), "--out",
                     str(run), *set_args(TINY)]) == 0
        out[family] = run
    return out


def config_of(family: str) -> str:
    return f"src/exactstep/configs/{family}_stdlib.toml"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mass", "bart"])
def test_a_run_reports_reconstruction_and_the_copy_baseline(runs, family):
    path, run = config_of(family), runs[family]
    summary = json.loads((run / "summary.json").read_text())
    assert -1.0 <= summary["reconstruction"] <= 1.0 and summary["reconstruction_n"] > 0
    parts = open_family(load_config(path, [f"{k}={v}" for k, v in TINY.items()]))
    pieces = heldout_pieces(parts.data.val, 64, 64)
    if family == "bart":
        items = [parts.compiler.noise_piece(e, p) for e, p in pieces]
        copies = [list(i.inputs[:-1]) for i in items]
        references = [list(i.targets[:-1]) for i in items]
    else:
        items = [i for i in (parts.compiler.mask_piece(e, p) for e, p in pieces)
                 if len(i.targets)]
        copies = [list(i.inputs[i.start:i.start + len(i.targets)]) for i in items]
        references = [list(i.targets) for i in items]
    assert summary["reconstruction_n"] == len(items)
    total = sum(len(r) for r in references)
    edits = sum(brute(tuple(c), tuple(r)) for c, r in zip(copies, references, strict=True))
    assert summary["copy_baseline"] == pytest.approx(1 - edits / total, abs=1e-12)


@pytest.mark.slow
def test_greedy_fragments_is_an_argmax_loop(runs):
    with open_finished_run(runs["mass"]) as finished:
        model, parts = finished.model, finished.parts
        (example, piece), = heldout_pieces(parts.data.val, 1, 16)
        item = parts.compiler.mask_piece(example, piece)
        k, mask = len(item.targets), parts.compiler.mask_id
        model.eval()
        got, = greedy_fragments(model, [item.inputs.tolist()], [item.start], [k],
                                start_id=mask, source_pad_id=parts.tokenizer.pad_id)
        source = source_rows([item.inputs.tolist()], parts.tokenizer.pad_id)
        tokens = [mask]
        with torch.no_grad():
            for _ in range(k):
                batch = single_segment_batch(torch.tensor([tokens]))
                batch = replace(batch, position_ids=batch.position_ids + item.start)
                hidden = model.decode(batch, model.encode(source), source)
                tokens.append(int(model.logits(hidden)[0, -1].argmax()))
    assert got == tokens[1:] and len(got) == k
