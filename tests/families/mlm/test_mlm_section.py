"""The run's ``[mlm]`` section is what its batches are corrupted with (R8, S1).

Through the real entry point (``load_config`` with overrides, ``resolve``,
``open_family``) a run configured with non-default rates (``mask_rate = 0.4``,
``replace_mask = 0.5``, ``replace_random = 0.3``) compiles its training stream with
them: every packed piece selects exactly ``max(1, floor(0.4 * eligible + 0.5))`` of its
non-special tokens (the documented count, worked out here in exact rationals from the
batch's own tokens), and over the several thousand selected positions of many
compiled batches the mask / random / keep split is within 5 standard deviations of
Binomial(n, 0.5 / 0.3 / 0.2), each bound computed from n and p in the test. The
manifest records these rates, so a run that compiled with others would be mislabelled.

Negative control: the glue planted so that it hands the compiler the section's
defaults (``MLMConfig()``: 15% selected, 80/10/10) instead of ``cfg.mlm``; the same
check then reports violations, while the manifest section still says 0.4 / 0.5 / 0.3.
"""

from __future__ import annotations

import math
from fractions import Fraction

from mlm_reference import IGNORE_INDEX, SPECIAL
from text_corpus import write_corpus

import exactstep.families.mlm.family as mlm_family
from exactstep.config import load_config
from exactstep.families import open_family, resolve
from exactstep.families.mlm.compiler import KEEP, MASK, RANDOM, MLMCompiler
from exactstep.families.mlm.config import MLMConfig
from exactstep.rows.stream import RowStream

#: The configured section, every rate away from BERT's defaults (0.15, 0.8, 0.1).
RATE, P_MASK, P_RANDOM = Fraction(2, 5), 0.5, 0.3
SECTION = {"mlm.mask_rate": "0.4", "mlm.replace_mask": "0.5", "mlm.replace_random": "0.3"}
BATCHES = 60  # 60 batches of 4 x 64 columns: several epochs of the small corpus
#: A count outside n p +- 5 sqrt(n p (1 - p)) happens with probability below 1e-6 for
#: a correct compiler (the draws are fixed by the seeds, so the check is deterministic).
SIGMAS = 5.0


def configured(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    overrides = {"objective.family": "mlm", "data.source": str(corpus),
                 "data.val_fraction": "0.1", "batch.seq_len": "64", "batch.rows": "4",
                 **SECTION}
    return resolve(load_config(None, [f"{k}={v}" for k, v in overrides.items()]))


def training_batches(cfg) -> list:
    """The first ``BATCHES`` batches of the run's training stream, as the runner builds
    it: the family's parts from ``open_family``, its compiler packing the train split."""
    parts = open_family(cfg)
    stream = RowStream(parts.data.train, cfg.batch, pad_id=parts.tokenizer.pad_id,
                       seed=cfg.seed, vocab_size=parts.tokenizer.vocab_size,
                       compiler=parts.compiler)
    return [stream.next_batch() for _ in range(BATCHES)]


def expected_count(eligible: int) -> int:
    """The documented count, ``max(1, floor(rate * eligible + 0.5))``, in rationals."""
    return 0 if eligible == 0 else max(1, math.floor(RATE * eligible + Fraction(1, 2)))


def outside(count: int, n: int, p: float) -> bool:
    return abs(count - n * p) > SIGMAS * math.sqrt(n * p * (1 - p))


def violations(batches) -> list[str]:
    """What the batches break of the configured section: per-piece selection counts
    (exact), and the mask / random / keep split over every selected position
    (binomial, 5 sigma). A piece's tokens are read back from the batch itself: a
    supervised column's original is its label, any other column shows its own."""
    found, wrong_counts, pieces = [], 0, 0
    actions = {MASK: 0, RANDOM: 0, KEEP: 0}
    for batch in batches:
        labels, inputs = batch.labels.tolist(), batch.input_ids.tolist()
        acts = batch.meta["mlm"].action.tolist()
        for b, row in enumerate(batch.segments):
            for seg in row:
                cols = range(seg.start, seg.stop)
                original = [labels[b][c] if labels[b][c] != IGNORE_INDEX else inputs[b][c]
                            for c in cols]
                eligible = sum(t not in SPECIAL for t in original)
                selected = sum(labels[b][c] != IGNORE_INDEX for c in cols)
                pieces += 1
                wrong_counts += selected != expected_count(eligible)
                for c in cols:
                    if labels[b][c] != IGNORE_INDEX:
                        actions[acts[b][c]] = actions.get(acts[b][c], 0) + 1
    if wrong_counts:
        found.append(f"{wrong_counts} of {pieces} pieces select other than "
                     f"max(1, floor({RATE} * eligible + 0.5)) tokens")
    n = sum(actions.values())
    for code, name, p in ((MASK, "mask", P_MASK), (RANDOM, "random", P_RANDOM),
                          (KEEP, "keep", 1 - P_MASK - P_RANDOM)):
        if outside(actions[code], n, p):
            found.append(f"{actions[code]} of {n} selected positions are '{name}', "
                         f"outside {n * p:.0f} +- {SIGMAS} sigma")
    return found


def test_the_run_compiles_its_batches_with_the_configured_rates(tmp_path):
    cfg = configured(tmp_path)
    assert (cfg.mlm.mask_rate, cfg.mlm.replace_mask, cfg.mlm.replace_random) == (0.4, 0.5, 0.3)
    batches = training_batches(cfg)
    selected = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
    assert selected > 4000  # enough positions for the split to tell 50/30/20 from 80/10/10
    assert violations(batches) == []


def test_negative_control_a_glue_built_from_the_defaults_is_caught(tmp_path, monkeypatch):
    """The planted defect: the glue's compiler gets ``MLMConfig()`` (the dataclass
    defaults), not the run's section; the manifest section is unchanged, the batches
    are not."""
    def from_defaults(settings, vocab, *, seed):
        return MLMCompiler(MLMConfig(), vocab, seed=seed)

    monkeypatch.setattr(mlm_family, "MLMCompiler", from_defaults)
    cfg = configured(tmp_path)
    selection = mlm_family.FAMILY.objective(cfg)["selection"]
    assert (selection["mask_rate"], selection["replace_mask"]) == (0.4, 0.5)  # still says so
    found = violations(training_batches(cfg))
    assert any("pieces select" in v for v in found)
    assert any("'mask'" in v for v in found) and any("'random'" in v for v in found)

