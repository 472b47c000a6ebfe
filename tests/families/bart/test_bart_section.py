"""The run's ``[bart]`` section is what its rows are noised with (R9, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family``) a run configured with the composition ``token_deletion,
sentence_permutation, text_infilling, token_masking`` and rates 0.1 / 0.2 (lambda 2)
/ 0.25 (BART-large's default: ``sentence_permutation, text_infilling`` at 0.3,
lambda 3) compiles its training stream with them. Every piece of many compiled
batches is read back from the batch alone: its decoder target must be the example's
own raw tokens + EOS, its decoder input BOS + those tokens, and its encoder input
exactly the oracle's composition (``bart_reference.compose``, written from the
definitions) of that target, in the configured order with the configured parameters,
fed the piece's addressed draws. The manifest records these settings.

Negative controls, each a planted glue defect whose batches the same check rejects:
the compiler handed the section's defaults, and the compiler handed the configured
functions in another order (the order is part of the passport).
"""

from __future__ import annotations

import pytest
from bart_reference import compose, draws_of
from families.corruption_support import Recording
from families.corruption_support import compiled as first_batches
from families.corruption_support import configured as configured_run
from run_support import EOS

import exactstep.families.bart.family as bart_family
from exactstep.families.bart.compiler import BartCompiler
from exactstep.families.bart.config import BartConfig

BOS, MASK = 256, 259
NOISE = ("token_deletion", "sentence_permutation", "text_infilling", "token_masking")
SECTION = {"bart.noise": ",".join(NOISE), "bart.token_deletion_rate": 0.1,
           "bart.text_infilling_rate": 0.2, "bart.poisson_lambda": 2.0,
           "bart.token_masking_rate": 0.25}
PARAMS = {"token_masking_rate": 0.25, "token_deletion_rate": 0.1,
          "text_infilling_rate": 0.2, "poisson_lambda": 2.0}
SEQ_LEN, BATCHES = 64, 30


def configured(tmp_path):
    return configured_run(tmp_path, "bart", SEQ_LEN, SECTION, seed=11)


def compiled(cfg):
    """The tokenizer, the train split and the first ``BATCHES`` batches of the run's
    training stream (every document more than once: epochs 0 and 1), as the runner
    builds them from ``open_family``'s parts, the compiler recording each batch's
    planned pieces (their epochs)."""
    return first_batches(cfg, BATCHES, wrap=Recording)


def violations(cfg, tokenizer, train, batches) -> list[str]:
    """What the run's tokenizer and batches break of the configured section, each kind
    once with how many pieces show it."""
    found = []
    if tokenizer.special_ids().get("mask") != MASK:
        found.append("the tokenizer's <mask> is not 259")
    by_id = {e.example_id: e.tokens.tolist() for e in train}
    kinds: dict[str, int] = {}
    pieces = masks = 0
    epochs = set()
    for batch in batches:
        enc_ids, labels = batch.source.input_ids.tolist(), batch.labels.tolist()
        dec_ids = batch.input_ids.tolist()
        for b, (dec_row, enc_row) in enumerate(zip(batch.segments, batch.source.segments,
                                                   strict=True)):
            for d, e, piece in zip(dec_row, enc_row, batch.meta["pieces"][b], strict=True):
                enc, target = enc_ids[b][e.start:e.stop], labels[b][d.start:d.stop]
                tokens = by_id[d.example_id]
                start = max(d.offset, 1)
                raw = target[:-1]
                if target[-1:] != [EOS] or raw != tokens[start:start + len(raw)]:
                    kinds["the target is not the original piece + EOS"] = \
                        kinds.get("the target is not the original piece + EOS", 0) + 1
                if dec_ids[b][d.start:d.stop] != [BOS, *raw]:
                    kinds["the decoder input is not BOS + the piece"] = \
                        kinds.get("the decoder input is not BOS + the piece", 0) + 1
                draws = draws_of(cfg.seed, piece.epoch, d.example_id, d.piece)
                if enc != compose(raw, NOISE, PARAMS, draws, MASK) + [EOS]:
                    kinds["the encoder input is not the configured composition"] = \
                        kinds.get("the encoder input is not the configured composition", 0) + 1
                pieces += 1
                epochs.add(piece.epoch)
                masks += enc.count(MASK)
    assert pieces > 100 and masks > 100  # the check saw many pieces, and noise in them
    assert epochs == {0, 1}
    return found + [f"{kind} in {n} of {pieces} pieces" for kind, n in kinds.items()]


def test_the_run_noises_its_rows_with_the_configured_section(tmp_path):
    cfg = configured(tmp_path)
    assert cfg.bart.noise == NOISE and cfg.bart.poisson_lambda == 2.0
    tokenizer, train, batches = compiled(cfg)
    assert violations(cfg, tokenizer, train, batches) == []
    section = bart_family.FAMILY.objective(cfg)
    assert section["noise"] == list(NOISE)
    assert [(f["name"], f.get("rate")) for f in section["composition"]] == [
        ("token_deletion", 0.1), ("sentence_permutation", None), ("text_infilling", 0.2),
        ("token_masking", 0.25)]


def compiler_from_defaults(monkeypatch):
    def from_defaults(bart, **ids):
        return BartCompiler(BartConfig(), **ids)

    monkeypatch.setattr(bart_family, "BartCompiler", from_defaults)


def compiler_in_another_order(monkeypatch):
    def sorted_order(bart, **ids):
        from dataclasses import replace
        return BartCompiler(replace(bart, noise=tuple(sorted(bart.noise))), **ids)

    monkeypatch.setattr(bart_family, "BartCompiler", sorted_order)


@pytest.mark.parametrize("plant", [compiler_from_defaults, compiler_in_another_order])
def test_negative_control_a_glue_that_misreads_the_section_is_caught(tmp_path, monkeypatch,
                                                                    plant):
    plant(monkeypatch)
    cfg = configured(tmp_path)
    found = violations(cfg, *compiled(cfg))
    assert any(v.startswith("the encoder input is not the configured composition")
               for v in found), found
    assert bart_family.FAMILY.objective(cfg)["noise"] == list(NOISE)  # still says so
