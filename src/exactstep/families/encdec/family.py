"""The encoder-decoder family (R8): pairs (the built-in numwords by default), the pair
compiler (``compiler.py``), the built-in encoder-decoder, and greedy exact match on
held-out pairs, isolated as evaluation is (E1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exactstep.config import RunConfig
from exactstep.data.pairs import (
    NUMWORDS_SOURCE,
)
from exactstep.errors import ConfigError
from exactstep.eval import isolated
from exactstep.families.encdec.compiler import (
    EncDecCompiler,
    PairExample,
    load_pair_bundle,
    source_len_of,
    source_pad_of,
)
from exactstep.families.registry import Family
from exactstep.model.encdec import build_encoder_decoder, greedy_decode
from exactstep.rows.example import DataBundle


def encdec_compiler(cfg: RunConfig, tokenizer: Any) -> EncDecCompiler:
    """The run's compiler; ``ConfigError`` for a source pad id outside the vocabulary
    or ``batch.boundary = "keep"`` (a target never crosses into the next pair)."""
    source_pad = source_pad_of(cfg.encdec, tokenizer)
    if not 0 <= source_pad < tokenizer.vocab_size:
        raise ConfigError(f"encdec.source_pad_id = {source_pad} is outside the vocabulary "
                          f"[0, {tokenizer.vocab_size}); use -1 for the tokenizer's pad id")
    if cfg.batch.boundary != "ignore":
        raise ConfigError("batch.boundary = 'keep' has no meaning for objective.family = "
                          "'encdec' (each pair's targets are its own); use 'ignore'")
    return EncDecCompiler(source_len=source_len_of(cfg.encdec, cfg.batch.seq_len),
                          pad_id=tokenizer.pad_id, source_pad_id=source_pad)


def encdec_objective(cfg: RunConfig) -> dict[str, Any]:
    return {"family": "encoder_decoder", "shift_owner": "collator",
            "ownership": "target_tokens", "estimator": "teacher_forced_mle",
            "decoder_input": "tgt[:-1]", "targets": "tgt[1:]",
            "source_len": source_len_of(cfg.encdec, cfg.batch.seq_len)}


def load_pairs(cfg: RunConfig, tokenizer: Any, *, share: tuple[int, int] = (0, 1)
               ) -> DataBundle:
    """Both splits of the run's pairs, read with its ``encdec`` section; pairs carry no
    further columns (``data.columns`` is refused)."""
    if cfg.data.columns:
        raise ConfigError("data.columns reads further fields of text or chat sources; the "
                          "encoder-decoder's pairs carry none: drop data.columns")
    return load_pair_bundle(cfg, cfg.encdec, tokenizer, share=share)


def build_encdec_model(cfg: RunConfig, vocab_size: int) -> Any:
    return build_encoder_decoder(cfg, vocab_size)


def greedy_exact_match(model: Any, examples: Sequence[PairExample], tokenizer: Any, *,
                       device: Any, max_new_tokens: int, source_pad_id: int) -> float:
    """The fraction of ``examples`` whose greedy answer (from ``BOS``, until ``EOS``,
    at most ``max_new_tokens`` tokens) is exactly the target. Isolated (E1): eval mode,
    no gradient, every RNG stream restored, the model's modes restored."""
    inner = getattr(model, "module", model)  # a DDP-wrapped model decodes as itself
    with isolated(model):
        answers = greedy_decode(inner, [e.source for e in examples], bos_id=tokenizer.bos_id,
                                eos_id=tokenizer.eos_id, source_pad_id=source_pad_id,
                                max_new_tokens=max_new_tokens, device=device)
    wanted = [e.tokens[1:-1].tolist() for e in examples]
    return sum(a == w for a, w in zip(answers, wanted, strict=True)) / len(examples)


def encdec_score(model: Any, parts: Any, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """End-of-run greedy exact match on at most ``encdec.n_heldout`` validation pairs."""
    spec = cfg.encdec
    examples = [e for e in parts.data.val if isinstance(e, PairExample)][: spec.n_heldout]
    accuracy = greedy_exact_match(model, examples, parts.tokenizer, device=device,
                                  max_new_tokens=spec.max_new_tokens,
                                  source_pad_id=source_pad_of(spec, parts.tokenizer))
    return {"exact_match": accuracy, "exact_match_n": len(examples),
            "exact_match_of": "held-out pairs"}


FAMILY = Family(name="encdec", model="encdec", data_kind="pairs",
                default_source=NUMWORDS_SOURCE, compiler=encdec_compiler,
                objective=encdec_objective, build_model=build_encdec_model,
                load=load_pairs, score=encdec_score)
