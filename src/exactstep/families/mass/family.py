"""The MASS family (R9, Song et al. 2019): text, the MASS compiler (``compiler.py``), its
``<mask>`` special and the built-in encoder-decoder.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.eval import edit_accuracy, heldout_pieces
from exactstep.families.mass.compiler import MASK_NAME, MASS_STREAM, MassCompiler
from exactstep.families.mass.config import row_shape
from exactstep.families.registry import Family
from exactstep.model.encdec import build_encoder_decoder, greedy_fragments
from exactstep.state.rng import isolated


def mass_specials(cfg: RunConfig) -> tuple[str, ...]:
    """The ``<mask>`` token the encoder shows and the decoder starts from."""
    return (MASK_NAME,)


def content_ids(tokenizer: Any) -> np.ndarray:
    """Every id that is not a special token, ascending: the random replacements' pool."""
    special = sorted(set(tokenizer.special_ids().values()))
    return np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), special)


def mass_compiler(cfg: RunConfig, tokenizer: Any) -> MassCompiler:
    """The run's compiler; ``ConfigError`` for a setting that means nothing here
    (``batch.boundary = "keep"``: a piece's fragment never continues into the next) and
    for a row that cannot hold a fragment (``row_shape``)."""
    if cfg.batch.boundary != "ignore":
        raise ConfigError(
            "batch.boundary = 'keep' has no meaning for MASS (each piece's target is its own "
            "fragment); leave batch.boundary = 'ignore'"
        )
    compiler = MassCompiler(cfg.mass, seed=cfg.seed, bos_id=tokenizer.bos_id,
                            eos_id=tokenizer.eos_id, mask_id=tokenizer.extra_id(MASK_NAME),
                            content_ids=content_ids(tokenizer))
    compiler.capacity(cfg.batch)  # refuses a row too short, now
    return compiler


def mass_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's ``objective`` section (S1, R9): the compiler's passport —
    selection law, replacement policy, decoder layout, RNG address and row shape."""
    mass = cfg.mass
    capacity, encoder, decoder = row_shape(mass, cfg.batch.seq_len)
    return {"family": "mass", "shift_owner": "collator", "ownership": "fragment_tokens",
            "estimator": "teacher_forced_mle", "fraction": mass.fraction,
            "fragment_length": "min(max(round(r * fraction), 1), r) for r >= 1 content tokens",
            "start": mass.start, "mask_rate": mass.mask_rate, "random_rate": mass.random_rate,
            "keep_rate": mass.keep_rate, "mask_token": MASK_NAME,
            "random_tokens": "uniform over non-special ids",
            "decoder": "fragment only, shifted right, at its original encoder positions",
            "decoder_start": MASK_NAME, "content_tokens_per_row": capacity,
            "encoder_columns": encoder, "decoder_columns": decoder,
            "rng": f"numpy default_rng([seed, {MASS_STREAM:#x}, epoch, example_id, piece]): "
                   "integers(0, r - k + 1), random(k), integers(0, n_content, k)"}


def build_mass_model(cfg: RunConfig, vocab_size: int) -> Any:
    """The built-in encoder-decoder (``model.encdec``)."""
    return build_encoder_decoder(cfg, vocab_size)


HELDOUT = 64  # held-out pieces the end-of-run reconstruction reads
HELDOUT_TOKENS = 64  # content tokens of each


def mass_score(model: Any, parts: Any, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """End-of-run reconstruction (R9): the first ``HELDOUT`` held-out documents, each
    one piece of at most ``HELDOUT_TOKENS`` content tokens with its fragment masked as
    in training; the model's greedy fragment (its length known, from ``<mask>`` at the
    fragment's positions) against the original, as the share of fragment tokens right
    (``edit_accuracy`` of equal lengths), beside the copy baseline's (the encoder's
    tokens at the fragment: masks, random tokens and the kept ones)."""
    compiler = parts.compiler
    items = [compiler.mask_piece(e, p) for e, p in heldout_pieces(parts.data.val, HELDOUT,
                                                                   HELDOUT_TOKENS)]
    items = [item for item in items if len(item.targets)]
    references = [item.targets.tolist() for item in items]
    with isolated(model):
        hypotheses = greedy_fragments(model, [item.inputs.tolist() for item in items],
                                      [item.start for item in items],
                                      [len(item.targets) for item in items],
                                      start_id=compiler.mask_id,
                                      source_pad_id=parts.tokenizer.pad_id, device=device)
    copies = [item.inputs[item.start:item.start + len(item.targets)].tolist()
              for item in items]
    return {"reconstruction": edit_accuracy(hypotheses, references),
            "copy_baseline": edit_accuracy(copies, references),
            "reconstruction_n": len(items),
            "reconstruction_of": f"held-out fragments of pieces of up to {HELDOUT_TOKENS} "
                                 "tokens, greedy; share of fragment tokens right"}


FAMILY = Family(name="mass", model="encdec", data_kind="text", default_source="stdlib",
                compiler=mass_compiler, objective=mass_objective, build_model=build_mass_model,
                specials=mass_specials, score=mass_score)
