"""The span family end to end short of training (R6, R8, S1): ``objective.family =
span`` alone opens the stdlib corpus with T5's sentinels in the byte tokenizer, the
manifest section says how rows are made, ``exactstep inspect`` shows sentinels on
both sides, and the end-of-run baseline is a unigram over span targets."""

from __future__ import annotations

import json

import numpy as np
import pytest
from families.corruption_support import (
    assert_boundary_keep_is_refused,
    assert_the_family_alone_opens_the_stdlib_corpus,
    family_fixtures,
    inspected,
)

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.eval import target_counts, unigram_bits_on
from exactstep.families import open_family, resolve
from exactstep.families.span.family import span_objective
from exactstep.rows.stream import eval_batches

SMALL = ["objective.family=span", "data.val_fraction=0.3", "batch.seq_len=64", "batch.rows=2",
         "span.sentinels=6"]

corpus, parts = family_fixtures("span", SMALL)


def test_the_family_alone_opens_the_stdlib_corpus():
    assert_the_family_alone_opens_the_stdlib_corpus("span")


def test_the_family_opens_text_with_descending_sentinels(parts):
    cfg, p = parts
    assert (cfg.data.kind, p.family.model) == ("text", "encdec")
    tok = p.tokenizer
    assert tok.vocab_size == 259 + 6
    assert [tok.extra_id(f"extra_id_{k}") for k in range(6)] == [264, 263, 262, 261, 260, 259]
    assert p.compiler.sentinels.tolist() == [264, 263, 262, 261, 260, 259]


def test_a_boundary_policy_that_means_nothing_here_is_refused(corpus):
    assert_boundary_keep_is_refused(SMALL + corpus)


def test_weighted_examples_carry_their_weight_on_every_decoder_column(parts):
    from dataclasses import replace

    from exactstep.rows.stream import RowStream

    cfg, p = parts
    weighted = [replace(e, weight=0.5 + e.example_id) for e in p.data.train]
    batch = next(iter(RowStream(weighted, cfg.batch, pad_id=p.tokenizer.pad_id, seed=0,
                                compiler=p.compiler)))
    for b, segments in enumerate(batch.segments):
        for seg in segments:
            assert batch.weights[b, seg.start:seg.stop].tolist() == [0.5 + seg.example_id] * \
                seg.length
    assert float(batch.weights[batch.segment_ids == 0].abs().sum()) == 0.0


def test_the_manifest_section_records_how_rows_are_made(parts):
    cfg, _ = parts
    section = span_objective(cfg)
    assert section["family"] == "span_corruption" and section["shift_owner"] == "collator"
    assert (section["raw_tokens_per_row"], section["encoder_columns"],
            section["decoder_columns"]) == (70, 64, 14)
    assert section["noise_density"] == 0.15 and section["sentinels"] == 6


def test_too_few_sentinels_are_refused_before_a_run(corpus):
    cfg = resolve(load_config(None, SMALL[:-1] + corpus + ["span.sentinels=2"]))
    with pytest.raises(ConfigError, match="span.sentinels >= 3"):
        open_family(cfg)


def test_inspect_shows_sentinels_on_both_sides(corpus, capsys):
    text = inspected(SMALL + corpus, capsys)
    encoder = [line for line in text.splitlines() if line.strip().startswith("encoder:")]
    target = [line for line in text.splitlines() if line.strip().startswith("target:")]
    assert encoder and target
    assert all("<extra_id_0>" in line and line.endswith("<eos>") for line in encoder + target)
    assert all(line.split("target:")[1].strip().startswith("<extra_id_0>") for line in target)
    assert "decoder in" in text and "→ <extra_id_0>" in text


def test_the_unigram_baseline_counts_span_targets_on_the_held_out_targets(parts):
    """Fit on training span targets (sentinels present), scored on the held-out span
    targets with evaluate's stopping rule; checked against a count written out here."""
    cfg, p = parts
    vocab = p.tokenizer.vocab_size

    def batches(examples):
        return eval_batches(examples, cfg.batch, pad_id=p.tokenizer.pad_id, compiler=p.compiler)

    counts, fitted = target_counts(batches(p.data.train), vocab, 300)
    assert counts[264] > 1  # extra_id_0 (every piece has it) was counted
    labels = [t for b in batches(p.data.train) for t in b.labels.flatten().tolist() if t >= 0]
    expected = np.ones(vocab)
    seen = 0
    for batch in batches(p.data.train):
        if seen >= 300:
            break
        row = [t for t in batch.labels.flatten().tolist() if t >= 0]
        for t in row:
            expected[t] += 1
        seen += len(row)
    assert np.array_equal(counts, expected) and 300 <= fitted == seen < len(labels)
    bits = unigram_bits_on(batches(p.data.val), counts, 300)
    held = []
    for batch in batches(p.data.val):
        if len(held) >= 300:
            break
        held += [t for t in batch.labels.flatten().tolist() if t >= 0]
    p_of = expected / expected.sum()
    assert bits == pytest.approx(-sum(np.log2(p_of[t]) for t in held) / len(held), rel=1e-12)


def test_the_objective_section_is_json(parts):
    json.dumps(span_objective(parts[0]))
