"""The run's ``[span]`` section is what its rows are corrupted with (R8, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family``) a run configured with ``noise_density = 0.3``,
``mean_noise_span_length = 2`` and ``sentinels = 12`` (T5's defaults: 0.15, 3, 100)
compiles its training stream with them. Every piece of many compiled batches is read
back from the batch alone: its noise spans are the sentinel runs of its encoder
input, its noise tokens the rest of its decoder target, and input and target merged
give back the example's own raw tokens. Its noise tokens ``N`` and spans must be
exactly T5's for its raw length ``r``: ``round(0.3 r)`` and ``round(N / 2)``, each
clamped as T5 does (``span_reference.counts``, written from T5); its sentinels
``extra_id_0, extra_id_1, ...`` with ids ``vocab_size - 1 - k``, the tokenizer
``259 + 12`` ids, and the decoder side T5's target length for ``seq_len`` inputs
(``span_reference.t5_random_spans_helper``). The manifest records these settings.

Negative controls, each a planted glue defect whose batches the same check rejects:
the compiler handed the section's defaults for the corruption (``SpanConfig()``'s
density and span length; the sentinel count must match the ids the glue looked up,
or the compiler refuses loudly), and the tokenizer's specials read from the defaults
(100 sentinels).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from families.corruption_support import compiled as first_batches
from families.corruption_support import configured as configured_run
from run_support import EOS, VOCAB
from span_reference import counts, t5_random_spans_helper

import exactstep.families.span.family as span_family
from exactstep.families.span.compiler import SpanCompiler
from exactstep.families.span.config import SpanConfig

DENSITY, MEAN, SENTINELS, SEQ_LEN = 0.3, 2.0, 12, 64
SECTION = {"span.noise_density": DENSITY, "span.mean_noise_span_length": MEAN,
           "span.sentinels": SENTINELS}
BATCHES = 30  # 30 batches of 4 rows: every training document, more than once


def configured(tmp_path):
    return configured_run(tmp_path, "span", SEQ_LEN, SECTION)


def compiled(cfg):
    """The tokenizer, the train split and the first ``BATCHES`` batches of the run's
    training stream, as the runner builds them from ``open_family``'s parts."""
    return first_batches(cfg, BATCHES)


def runs(tokens: list[int], is_sentinel) -> list[list[int]]:
    """The runs of non-sentinel tokens between sentinels (after the first sentinel)."""
    out: list[list[int]] = []
    for t in tokens:
        if is_sentinel(t):
            out.append([])
        elif out:
            out[-1].append(t)
    return out


def is_sentinel(t: int) -> bool:
    return t >= VOCAB  # the bytes, BOS, EOS and pad lie below; the sentinels above


def read_piece(enc: list[int], target: list[int]) -> tuple[list[int], list[int], list[int]]:
    """One piece read back from its encoder input and decoder target (EOS cut off):
    ``(raw tokens, noise mask, sentinels of the input)``. The input is kept runs, each
    followed by its span's sentinel; the target each sentinel followed by its noise."""
    spans = [t for t in enc if is_sentinel(t)]
    kept_runs = [enc[: enc.index(spans[0])] if spans else enc, *runs(enc, is_sentinel)]
    noise_runs = runs(target, is_sentinel)
    raw, mask = [], []
    for i, run in enumerate(kept_runs):
        noise = noise_runs[i] if spans and i < len(noise_runs) else []
        raw += run + noise
        mask += [0] * len(run) + [1] * len(noise)
    return raw, mask, spans


def piece_violations(enc: list[int], target: list[int], source: list[int],
                     vocab: int) -> list[str]:
    """What one piece breaks: ``enc`` its encoder input, ``target`` its decoder target
    (both ending with EOS), ``source`` its example's tokens from the piece's first raw
    token on."""
    if enc[-1:] != [EOS] or target[-1:] != [EOS]:
        return ["a side does not end with EOS"]
    raw, mask, spans = read_piece(enc[:-1], target[:-1])
    r, noise, k = len(raw), sum(mask), len(spans)
    found = []
    if raw != source[:r]:
        found.append("input and target do not merge into the example's raw tokens")
    if (noise, k) != counts(r, DENSITY, MEAN):
        found.append(f"noise counts are not T5's for ({DENSITY}, {MEAN})")
    expected = [vocab - 1 - j for j in range(k)]  # extra_id_0, extra_id_1, ...
    # below two raw tokens nothing is noise, and the target is extra_id_0 alone
    in_target = [t for t in target if is_sentinel(t)]
    if spans != expected or in_target != (expected if r >= 2 else [vocab - 1][:r]):
        found.append(f"sentinels are not extra_id_k = {vocab} - 1 - k")
    return found


def violations(tokenizer, train, batches) -> list[str]:
    """What the run's tokenizer and batches break of the configured section: the
    vocabulary, the decoder width, and per piece (each kind once, with how many pieces
    show it and the density and mean span length observed over all pieces)."""
    vocab = VOCAB + SENTINELS
    found = []
    if tokenizer.vocab_size != vocab:
        found.append(f"the tokenizer has {tokenizer.vocab_size} ids, not {VOCAB} + {SENTINELS}")
    width = t5_random_spans_helper(SEQ_LEN, DENSITY, MEAN)[1]
    widths = {batch.labels.shape[1] for batch in batches}
    if widths != {width}:
        found.append(f"decoder sides of {sorted(widths)} columns, T5's is {width}")
    by_id = {e.example_id: e.tokens.tolist() for e in train}
    kinds: dict[str, int] = {}
    pieces = raw = noise = spans = 0
    for batch in batches:
        enc_ids, labels = batch.source.input_ids.tolist(), batch.labels.tolist()
        for b, (dec_row, enc_row) in enumerate(zip(batch.segments, batch.source.segments,
                                                   strict=True)):
            for d, e in zip(dec_row, enc_row, strict=True):
                enc, target = enc_ids[b][e.start:e.stop], labels[b][d.start:d.stop]
                tokens = by_id[e.example_id]
                for kind in piece_violations(enc, target, tokens[max(e.offset, 1):], vocab):
                    kinds[kind] = kinds.get(kind, 0) + 1
                piece_raw, mask, piece_spans = read_piece(enc[:-1], target[:-1])
                pieces, raw = pieces + 1, raw + len(piece_raw)
                noise, spans = noise + sum(mask), spans + len(piece_spans)
    assert pieces > 100 and raw > 5000  # the check saw many pieces
    seen = f"observed density {noise / raw:.3f}, mean span length {noise / spans:.2f}"
    return found + [f"{kind} in {n} of {pieces} pieces ({seen})" for kind, n in kinds.items()]


def test_the_run_corrupts_its_rows_with_the_configured_section(tmp_path):
    cfg = configured(tmp_path)
    assert (cfg.span.noise_density, cfg.span.mean_noise_span_length,
            cfg.span.sentinels) == (DENSITY, MEAN, SENTINELS)
    assert violations(*compiled(cfg)) == []
    section = span_family.FAMILY.objective(cfg)
    assert (section["noise_density"], section["mean_noise_span_length"],
            section["sentinels"]) == (DENSITY, MEAN, SENTINELS)


def compiler_from_defaults(monkeypatch):
    def from_defaults(span, **ids):
        return SpanCompiler(SpanConfig(sentinels=span.sentinels), **ids)

    monkeypatch.setattr(span_family, "SpanCompiler", from_defaults)


def specials_from_defaults(monkeypatch):
    family = span_family.FAMILY
    monkeypatch.setattr(span_family, "FAMILY", replace(
        family, specials=lambda cfg: family.specials(replace(cfg, span=SpanConfig()))))


@pytest.mark.parametrize("plant, seen", [
    (compiler_from_defaults, "noise counts are not T5's"),
    (specials_from_defaults, "sentinels are not extra_id_k"),
])
def test_negative_control_a_glue_reading_the_defaults_is_caught(tmp_path, monkeypatch, plant,
                                                                seen):
    plant(monkeypatch)
    cfg = configured(tmp_path)
    found = violations(*compiled(cfg))
    assert any(v.startswith(seen) for v in found), found
    if plant is specials_from_defaults:
        assert "the tokenizer has 359 ids, not 259 + 12" in found
    assert span_family.FAMILY.objective(cfg)["noise_density"] == DENSITY  # still says so
