"""The BART family end to end (R9, R6, S1, X4): ``objective.family = bart`` alone opens
the stdlib corpus with a ``<mask>`` special, the manifest section is the compiler's
passport (the composition in order with its parameters, the rng address, the
splitter), ``bart.noise`` reads as a TOML array or from ``--set``, ``exactstep
inspect`` shows the noised source, the decoder input and the owned target of each
pair, a tiny ``exactstep train`` run trains with finite loss and records the bart
keys, and each refusal is one ``error:`` line."""

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

from exactstep.config import load_config
from exactstep.errors import ConfigError
from exactstep.families import open_family, resolve
from exactstep.families.bart.family import bart_objective

SMALL = ["objective.family=bart", "data.val_fraction=0.3", "batch.seq_len=64", "batch.rows=2"]

corpus, parts = family_fixtures("bart", SMALL)


def test_the_family_alone_opens_the_stdlib_corpus():
    assert_the_family_alone_opens_the_stdlib_corpus("bart")


def test_the_family_opens_text_with_a_mask_special(parts):
    cfg, p = parts
    assert (cfg.data.kind, p.family.model) == ("text", "encdec")
    assert p.tokenizer.vocab_size == 260 and p.tokenizer.extra_id("mask") == 259
    assert p.compiler.mask_id == 259 and p.compiler.bart == cfg.bart


def test_the_manifest_section_is_the_compilers_passport_r9(parts):
    cfg, _ = parts
    section = bart_objective(cfg)
    assert section["family"] == "bart" and section["shift_owner"] == "collator"
    assert section["noise"] == ["sentence_permutation", "text_infilling"]
    infilling = section["composition"][1]
    assert infilling["name"] == "text_infilling" and infilling["rate"] == 0.3
    assert infilling["poisson_lambda"] == 3.0
    assert "splitter" in section["composition"][0]
    assert "0x42415254, epoch, example_id, piece" in section["noise_rng"]
    assert (section["raw_tokens_per_row"], section["encoder_columns"],
            section["decoder_columns"]) == (63, 64, 64)
    json.dumps(section)


def test_the_composition_reads_from_toml_and_from_set(tmp_path):
    path = tmp_path / "bart.toml"
    path.write_text('[bart]\nnoise = ["text_infilling", "sentence_permutation"]\n')
    order = ("text_infilling", "sentence_permutation")
    assert load_config(path).bart.noise == order
    assert load_config(None, ['bart.noise=["text_infilling", "sentence_permutation"]']
                       ).bart.noise == order
    assert load_config(None, ["bart.noise=text_infilling, sentence_permutation"]).bart.noise \
        == order
    assert load_config(None, ['bart={"noise": ["document_rotation"]}']).bart.noise == \
        ("document_rotation",)
    with pytest.raises(ConfigError, match="bart.noise must be a list of strings"):
        load_config(None, ["bart.noise=[1, 2]"])


def test_inspect_shows_source_decoder_input_and_target(corpus, capsys):
    text = inspected(SMALL + corpus, capsys)
    lines = text.splitlines()
    source = [x.split("source:", 1)[1].strip() for x in lines if x.strip().startswith("source:")]
    dec_in = [x.split("decoder in:", 1)[1].strip() for x in lines
              if x.strip().startswith("decoder in:")]
    target = [x.split("target:", 1)[1].strip() for x in lines if x.strip().startswith("target:")]
    assert source and len(source) == len(dec_in) == len(target)
    assert any("<mask>" in s for s in source) and all(s.endswith("<eos>") for s in source)
    assert all("<mask>" not in t and t.endswith("<eos>") for t in target)
    assert all(d == "<bos>" + t[: -len("<eos>")] for d, t in zip(dec_in, target, strict=True))
    assert "decoder in" in text and " own" in text


@pytest.mark.parametrize("override, needle", [
    ("batch.boundary=keep", "batch.boundary = 'keep' has no meaning for BART"),
    ("bart.noise=", "leaves nothing to reconstruct"),
    ('bart={"noise": ["token_masking"], "token_masking_rate": 0}',
     "leaves nothing to reconstruct (bart.token_masking_rate = 0)"),
    ("bart.noise=text_infilling,shuffle", "'shuffle', which is not a noising function"),
    ("bart.text_infilling_rate=1.5", "bart.text_infilling_rate must be in [0, 1]"),
    ("bart.poisson_lambda=0", "bart.poisson_lambda must be > 0"),
    ("batch.seq_len=2", "too short for BART denoising"),
    ("data.tokenizer=hf", "declares no sentence splitter"),
])
def test_each_refusal_is_one_error_line(corpus, tmp_path, capsys, override, needle):
    assert_one_error_line(SMALL + corpus + [override], tmp_path, capsys, needle)


def test_refusals_come_from_open_family(corpus):
    """The same refusals through the entry point every command shares."""
    assert_boundary_keep_is_refused(SMALL + corpus)
    cfg = resolve(load_config(None, SMALL + corpus + ["data.tokenizer=hf",
                                                     "data.tokenizer_path=/nowhere"]))
    with pytest.raises(ConfigError, match="bart.noise lists 'sentence_permutation'"):
        open_family(cfg)
    # without sentence permutation the HF tokenizer is refused for lacking <mask> instead
    cfg = resolve(load_config(None, SMALL + corpus + [
        "data.tokenizer=hf", "data.tokenizer_path=/nowhere", "bart.noise=text_infilling"]))
    with pytest.raises(ConfigError, match="only the built-in byte tokenizer provides"):
        open_family(cfg)


SETTINGS = tiny_settings("bart", {
    "bart.noise": "sentence_permutation,token_masking,text_infilling,document_rotation"})


def test_a_tiny_run_trains_and_records_the_bart_keys(corpus, tmp_path: Path):
    manifest, _ = tiny_run(SETTINGS, corpus, tmp_path / "run")
    objective = manifest["objective"]
    noise = ["sentence_permutation", "token_masking", "text_infilling", "document_rotation"]
    assert objective["family"] == "bart" and objective["noise"] == noise
    assert [f["name"] for f in objective["composition"]] == noise
    assert manifest["config"]["bart"] == {"noise": noise, "token_masking_rate": 0.15,
                                          "token_deletion_rate": 0.15,
                                          "text_infilling_rate": 0.3, "poisson_lambda": 3.0}


def test_the_shipped_config_resolves_to_bart_larges_recipe():
    from importlib import resources

    path = resources.files("exactstep") / "configs" / "bart_stdlib.toml"
    cfg = resolve(load_config(str(path), ["data.max_docs=40", "data.val_fraction=0.3"]))
    assert (cfg.objective.family, cfg.data.source) == ("bart", "stdlib")
    assert cfg.bart.noise == ("sentence_permutation", "text_infilling")
    assert (cfg.bart.text_infilling_rate, cfg.bart.poisson_lambda) == (0.3, 3.0)
    parts = open_family(cfg)
    assert parts.compiler.widths(cfg.batch) == (128, 128)
    assert bart_objective(cfg)["raw_tokens_per_row"] == 127
