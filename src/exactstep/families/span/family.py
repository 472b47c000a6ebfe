"""The span-corruption family (R8, T5-style): text, the span compiler (``compiler.py``), its
sentinel specials and the built-in encoder-decoder.
"""

from __future__ import annotations

from typing import Any

from exactstep.config import RunConfig
from exactstep.errors import ConfigError
from exactstep.families.registry import Family
from exactstep.families.span.compiler import SENTINEL_PREFIX, SPAN_STREAM, SpanCompiler
from exactstep.families.span.config import row_shape
from exactstep.model.encdec import build_encoder_decoder


def span_specials(cfg: RunConfig) -> tuple[str, ...]:
    """``extra_id_{n-1}, ..., extra_id_0``: the byte tokenizer numbers extras upwards in
    the order asked, so ``extra_id_k`` gets ``vocab_size - 1 - k`` (T5's descending ids)."""
    return tuple(f"{SENTINEL_PREFIX}{k}" for k in reversed(range(cfg.span.sentinels)))


def span_compiler(cfg: RunConfig, tokenizer: Any) -> SpanCompiler:
    """The run's compiler; ``ConfigError`` for a setting that means nothing here
    (``batch.boundary = "keep"``: a piece's target never continues into the next) and
    for rows too short or too few sentinels (``row_shape``)."""
    if cfg.batch.boundary != "ignore":
        raise ConfigError(
            "batch.boundary = 'keep' has no meaning for span corruption (each piece has its "
            "own target, ending with EOS); leave batch.boundary = 'ignore'"
        )
    span = cfg.span
    ids = [tokenizer.extra_id(f"{SENTINEL_PREFIX}{k}") for k in range(span.sentinels)]
    compiler = SpanCompiler(span, seed=cfg.seed, bos_id=tokenizer.bos_id,
                            eos_id=tokenizer.eos_id, sentinel_ids=ids)
    compiler.capacity(cfg.batch)  # refuses a row too short, or too few sentinels, now
    return compiler


def span_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's ``objective`` section (S1): what the family optimises and how its
    rows are made, so two runs with other corruption settings cannot be confused."""
    span = cfg.span
    capacity, encoder, decoder = row_shape(span, cfg.batch.seq_len)
    return {"family": "span_corruption", "shift_owner": "collator",
            "ownership": "compact_sentinel_span_targets", "estimator": "teacher_forced_mle",
            "noise_density": span.noise_density,
            "mean_noise_span_length": span.mean_noise_span_length,
            "sentinels": span.sentinels, "sentinel_ids": "extra_id_k = vocab_size - 1 - k",
            "decoder_start": "bos", "raw_tokens_per_row": capacity,
            "encoder_columns": encoder, "decoder_columns": decoder,
            "corruption_rng": f"numpy default_rng([seed, {SPAN_STREAM:#x}, epoch, example_id, "
                              "piece])"}


def build_span_model(cfg: RunConfig, vocab_size: int) -> Any:
    """The built-in encoder-decoder (``model.encdec``)."""
    return build_encoder_decoder(cfg, vocab_size)


FAMILY = Family(name="span", model="encdec", data_kind="text", default_source="stdlib",
                compiler=span_compiler, objective=span_objective, build_model=build_span_model,
                specials=span_specials)
