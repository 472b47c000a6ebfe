"""The BART denoising family (R9): text, the BART compiler (``compiler.py``), its ``<mask>``
special, the byte tokenizer's sentence splitter and the built-in encoder-decoder.
"""

from __future__ import annotations

from typing import Any

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.eval import edit_accuracy, heldout_pieces
from exactstep.families.bart.compiler import BART_STREAM, MASK_NAME, BartCompiler
from exactstep.families.bart.config import row_shape
from exactstep.families.registry import Family
from exactstep.model.encdec import build_encoder_decoder, greedy_decode
from exactstep.state.rng import isolated


def check_splitter(cfg: RunConfig) -> None:
    """``sentence_permutation`` needs a declared sentence splitter; only the byte
    tokenizer has one (sentence ends are bytes), so another tokenizer is refused when
    the composition lists it (R9)."""
    if "sentence_permutation" in cfg.bart.noise and cfg.data.tokenizer != "bytes":
        raise ConfigError(
            f"bart.noise lists 'sentence_permutation' but data.tokenizer = "
            f"{cfg.data.tokenizer!r} declares no sentence splitter (only the byte tokenizer "
            "does: '. ', '! ', '? ', newline); drop it from bart.noise or set "
            "data.tokenizer = 'bytes'")


def bart_specials(cfg: RunConfig) -> tuple[str, ...]:
    """``<mask>``, the token masking and infilling write; refuses a composition the
    run's data cannot split into sentences first (``check_splitter``)."""
    check_splitter(cfg)
    return (MASK_NAME,)


def bart_compiler(cfg: RunConfig, tokenizer: Any) -> BartCompiler:
    """The run's compiler; ``ConfigError`` for ``batch.boundary = "keep"`` (a piece's
    target never continues into the next), for a composition without a splitter and
    for a row too short (``row_shape``)."""
    if cfg.batch.boundary != "ignore":
        raise ConfigError(
            "batch.boundary = 'keep' has no meaning for BART denoising (each piece has its "
            "own target, ending with EOS); leave batch.boundary = 'ignore'"
        )
    check_splitter(cfg)
    compiler = BartCompiler(cfg.bart, seed=cfg.seed, bos_id=tokenizer.bos_id,
                            eos_id=tokenizer.eos_id, mask_id=tokenizer.extra_id(MASK_NAME))
    compiler.capacity(cfg.batch)  # refuses a row too short, now
    return compiler


def bart_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's ``objective`` section (S1): the passport of R9 (the composition in
    order with its parameters, the rng address, the splitter, the boundaries)."""
    bart = cfg.bart
    capacity, encoder, decoder = row_shape(cfg.batch.seq_len)
    return {"family": "bart", "shift_owner": "collator",
            "ownership": "every_original_token_and_eos", "estimator": "teacher_forced_mle",
            "noise": list(bart.noise), "composition": bart.composition(),
            "mask_token": f"<{MASK_NAME}>",
            "sentence_splitter": "bytes: '. ', '! ', '? ', '\\n' end a sentence",
            "target": "the original piece + eos (decoder input: bos + original piece)",
            "boundaries": "each planned piece noised alone; bos/eos of the example never "
                          "noised; eos appended to the encoder side",
            "decoder_start": "bos", "raw_tokens_per_row": capacity,
            "encoder_columns": encoder, "decoder_columns": decoder,
            "noise_rng": f"numpy default_rng([seed, {BART_STREAM:#x}, epoch, example_id, "
                         "piece]), consumed by the functions in composition order"}


def build_bart_model(cfg: RunConfig, vocab_size: int) -> Any:
    """The built-in encoder-decoder (``model.encdec``)."""
    return build_encoder_decoder(cfg, vocab_size)


HELDOUT = 64  # held-out pieces the end-of-run reconstruction reads
HELDOUT_TOKENS = 64  # content tokens of each


def bart_score(model: Any, parts: Any, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """End-of-run reconstruction (R9): the first ``HELDOUT`` held-out documents, each
    one piece of at most ``HELDOUT_TOKENS`` content tokens noised by the run's
    composition; the model's greedy reconstruction against the original, as
    ``edit_accuracy``, beside the copy baseline's (the noised input taken as the
    reconstruction)."""
    compiler, tokenizer = parts.compiler, parts.tokenizer
    items = [compiler.noise_piece(e, p) for e, p in heldout_pieces(parts.data.val, HELDOUT,
                                                                    HELDOUT_TOKENS)]
    sources = [item.inputs.tolist() for item in items]
    references = [item.targets[:-1].tolist() for item in items]
    with isolated(model):
        hypotheses = greedy_decode(model, sources, bos_id=tokenizer.bos_id,
                                   eos_id=tokenizer.eos_id, source_pad_id=tokenizer.pad_id,
                                   max_new_tokens=HELDOUT_TOKENS + 8, device=device)
    return {"reconstruction": edit_accuracy(hypotheses, references),
            "copy_baseline": edit_accuracy([s[:-1] for s in sources], references),
            "reconstruction_n": len(items),
            "reconstruction_of": f"held-out pieces of up to {HELDOUT_TOKENS} tokens, greedy; "
                                 "1 - token edits / reference tokens"}


FAMILY = Family(name="bart", model="encdec", data_kind="text", default_source="stdlib",
                compiler=bart_compiler, objective=bart_objective, build_model=build_bart_model,
                specials=bart_specials, score=bart_score)
