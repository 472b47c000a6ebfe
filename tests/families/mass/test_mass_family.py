"""The MASS family end to end (R9, R6, S1): ``objective.family = mass`` alone opens
the stdlib corpus with a ``<mask>`` special, a tiny ``exactstep train`` run trains
with finite, falling loss and records the compiler's passport in its manifest,
``exactstep inspect`` shows the source, the decoder input and the owned target of each
pair, and each refusal is one ``error:`` line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families.corruption_support import (
    assert_boundary_keep_is_refused,
    assert_one_error_line,
    assert_the_family_alone_opens_the_stdlib_corpus,
    family_fixtures,
    inspected,
    tiny_run,
    tiny_settings,
)

from exactstep.families.mass.family import mass_objective

SMALL = ["objective.family=mass", "data.val_fraction=0.3", "batch.seq_len=64", "batch.rows=2"]

corpus, parts = family_fixtures("mass", SMALL)


def test_the_family_alone_opens_the_stdlib_corpus():
    assert_the_family_alone_opens_the_stdlib_corpus("mass")


def test_the_family_opens_text_with_a_mask_special(parts):
    cfg, p = parts
    assert (cfg.data.kind, p.family.model) == ("text", "encdec")
    assert p.tokenizer.vocab_size == 260 and p.tokenizer.extra_id("mask") == 259
    assert p.compiler.mask_id == 259 and p.compiler.content.tolist() == list(range(256))


def test_the_manifest_section_is_the_compilers_passport_r9(parts):
    cfg, _ = parts
    section = mass_objective(cfg)
    assert section["family"] == "mass" and section["shift_owner"] == "collator"
    assert (section["fraction"], section["start"], section["mask_rate"],
            section["random_rate"], section["keep_rate"]) == (0.5, "uniform", 0.8, 0.1, 0.1)
    assert (section["content_tokens_per_row"], section["encoder_columns"],
            section["decoder_columns"]) == (63, 64, 32)
    assert "0x4d415353" in section["rng"] and "original encoder positions" in section["decoder"]
    json.dumps(section)


def test_inspect_shows_source_decoder_input_and_target(corpus, capsys):
    text = inspected(SMALL + corpus, capsys)
    lines = text.splitlines()
    encoder = [x for x in lines if x.strip().startswith("encoder:")]
    decoder = [x for x in lines if x.strip().startswith("decoder:")]
    target = [x for x in lines if x.strip().startswith("target:")]
    assert encoder and len(encoder) == len(decoder) == len(target)
    assert all(x.endswith("<eos>") and "<mask>" in x for x in encoder)
    assert all(x.split("decoder:")[1].strip().startswith("<mask>") for x in decoder)
    assert "decoder in" in text and "pos" in text


@pytest.mark.parametrize("override, needle", [
    ("batch.boundary=keep", "batch.boundary = 'keep' has no meaning for MASS"),
    ("mass.keep_rate=0.2", "mass.mask_rate + mass.random_rate + mass.keep_rate must sum to 1"),
    ("batch.seq_len=1", "batch.seq_len must be >= 2"),
])
def test_each_refusal_is_one_error_line(corpus, tmp_path, capsys, override, needle):
    assert_one_error_line(SMALL + corpus + [override], tmp_path, capsys, needle)


def test_a_boundary_policy_that_means_nothing_here_is_refused(corpus):
    assert_boundary_keep_is_refused(SMALL + corpus)


SETTINGS = tiny_settings("mass")


def test_a_tiny_run_trains_and_records_the_mass_keys(corpus, tmp_path: Path):
    manifest, losses = tiny_run(SETTINGS, corpus, tmp_path / "run")
    objective = manifest["objective"]
    assert objective["family"] == "mass" and objective["fraction"] == 0.5
    assert manifest["config"]["mass"] == {"fraction": 0.5, "start": "uniform", "mask_rate": 0.8,
                                          "random_rate": 0.1, "keep_rate": 0.1}
    assert min(losses[-2:]) < losses[0]
