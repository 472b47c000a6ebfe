"""The run's ``[mass]`` section is what its rows are masked with (R9, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family``) a run configured with ``fraction = 0.3`` and rates ``0.5 / 0.3 /
0.2`` (MASS's defaults: 0.5, 0.8 / 0.1 / 0.1) compiles its training stream with them.
Every piece of many batches is read back from the batch alone: its fragment is the
decoder's labels at the decoder's positions; its length must be ``round(0.3 r)``
clamped to ``[1, r]`` (``mass_reference.fragment_length``) for the piece's ``r``
content tokens; outside the fragment the encoder shows the example's own tokens; in
it each token is ``<mask>``, a non-special id or itself, in shares near the
configured rates; the decoder side is a full row's fragment wide. The manifest
records the settings.

Negative control: a planted glue defect, the compiler handed the section's defaults,
whose batches the same check rejects.
"""

from __future__ import annotations

from collections import Counter

import pytest
from families.corruption_support import compiled as first_batches
from families.corruption_support import configured as configured_run
from mass_reference import fragment_length

import exactstep.families.mass.family as mass_family
from exactstep.families.mass.compiler import MassCompiler
from exactstep.families.mass.config import MassConfig

FRACTION, MASK_RATE, RANDOM_RATE, KEEP_RATE, SEQ_LEN = 0.3, 0.5, 0.3, 0.2, 64
SECTION = {"mass.fraction": FRACTION, "mass.mask_rate": MASK_RATE,
           "mass.random_rate": RANDOM_RATE, "mass.keep_rate": KEEP_RATE}
BATCHES = 30


def configured(tmp_path):
    return configured_run(tmp_path, "mass", SEQ_LEN, SECTION)


def compiled(cfg):
    return first_batches(cfg, BATCHES)


def violations(tokenizer, train, batches) -> list[str]:
    mask = tokenizer.extra_id("mask")
    found: Counter[str] = Counter()
    shown: Counter[str] = Counter()
    width = fragment_length(SEQ_LEN - 1, FRACTION)
    if {batch.labels.shape[1] for batch in batches} != {width}:
        found["decoder side not a full row's fragment wide"] += 1
    by_id = {e.example_id: e.tokens.tolist() for e in train}
    pieces = 0
    for batch in batches:
        enc_ids, enc_pos = batch.source.input_ids.tolist(), batch.source.position_ids.tolist()
        labels, positions = batch.labels.tolist(), batch.position_ids.tolist()
        for b, (dec_row, enc_row) in enumerate(zip(batch.segments, batch.source.segments,
                                                   strict=True)):
            for d, e in zip(dec_row, enc_row, strict=True):
                pieces += 1
                enc = enc_ids[b][e.start:e.stop]
                r = e.length - 1
                source = by_id[e.example_id][max(e.offset, 1):][:r]
                target = [t for t in labels[b][d.start:d.stop] if t >= 0]
                if len(target) != fragment_length(r, FRACTION):
                    found[f"fragment length not round({FRACTION} r)"] += 1
                    continue
                if not target:
                    continue
                u = positions[b][d.start] - enc_pos[b][e.start]
                if target != source[u:u + len(target)]:
                    found["targets are not the fragment at its positions"] += 1
                outside = enc[:u] + enc[u + len(target):-1]
                if outside != source[:u] + source[u + len(target):]:
                    found["the encoder changed a token outside the fragment"] += 1
                for shown_token, own in zip(enc[u:u + len(target)], target, strict=True):
                    kind = ("mask" if shown_token == mask else "keep" if shown_token == own
                            else "random" if shown_token < 256 else "special")
                    shown[kind] += 1
    assert pieces > 100
    total = sum(shown.values())
    # a random byte equals its own token 1 time in 256: counted as keep, well inside
    for kind, rate in (("mask", MASK_RATE), ("random", RANDOM_RATE), ("keep", KEEP_RATE)):
        if abs(shown[kind] / total - rate) > 0.04:
            found[f"{kind} share {shown[kind] / total:.3f}, configured {rate}"] += 1
    if shown["special"]:
        found["a random replacement is a special token"] += 1
    return [f"{kind} ({n})" for kind, n in found.items()]


def test_the_run_masks_its_rows_with_the_configured_section(tmp_path):
    cfg = configured(tmp_path)
    assert (cfg.mass.fraction, cfg.mass.mask_rate, cfg.mass.random_rate,
            cfg.mass.keep_rate) == (FRACTION, MASK_RATE, RANDOM_RATE, KEEP_RATE)
    assert violations(*compiled(cfg)) == []
    section = mass_family.FAMILY.objective(cfg)
    assert (section["fraction"], section["mask_rate"], section["random_rate"],
            section["keep_rate"]) == (FRACTION, MASK_RATE, RANDOM_RATE, KEEP_RATE)


def test_negative_control_a_glue_reading_the_defaults_is_caught(tmp_path, monkeypatch):
    def from_defaults(mass, **ids):
        return MassCompiler(MassConfig(), **ids)

    monkeypatch.setattr(mass_family, "MassCompiler", from_defaults)
    cfg = configured(tmp_path)
    found = violations(*compiled(cfg))
    assert any(v.startswith("fragment length not round") for v in found), found
    assert any(v.startswith("decoder side not") for v in found), found
    assert mass_family.FAMILY.objective(cfg)["fraction"] == FRACTION  # still says so


@pytest.mark.parametrize("seen", ["mask share"])
def test_negative_control_the_shares_are_measured(tmp_path, monkeypatch, seen):
    """The compiler handed all-keep rates (the right fraction) fails the share check."""
    def keep_all(mass, **ids):
        return MassCompiler(MassConfig(fraction=mass.fraction, mask_rate=0.0, random_rate=0.0,
                                       keep_rate=1.0), **ids)

    monkeypatch.setattr(mass_family, "MassCompiler", keep_all)
    found = violations(*compiled(configured(tmp_path)))
    assert any(v.startswith(seen) for v in found), found
