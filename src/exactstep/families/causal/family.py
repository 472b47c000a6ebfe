"""The causal-LM family (R8): text, the causal compiler (``rows.causal``), the built-in
decoder or a Hugging Face causal LM; every next token is a target.
"""

from __future__ import annotations

from typing import Any

from exactstep.config import RunConfig
from exactstep.families.registry import DEFAULT_SOURCE, Family
from exactstep.model.decoder import build_model
from exactstep.rows.compiler import CAUSAL, RowCompiler


def causal_objective(cfg: RunConfig) -> dict[str, Any]:
    return {"family": "causal_lm", "shift_owner": "collator",
            "ownership": "all_next_tokens", "estimator": "teacher_forced_mle"}


def causal_compiler(cfg: RunConfig, tokenizer: Any) -> RowCompiler:
    return CAUSAL


def build_decoder(cfg: RunConfig, vocab_size: int) -> Any:
    return build_model(cfg.model, vocab_size, seed=cfg.seed, seq_len=cfg.batch.seq_len)


FAMILY = Family(name="causal", model="decoder", data_kind="text",
                default_source=DEFAULT_SOURCE, compiler=causal_compiler,
                objective=causal_objective, build_model=build_decoder)
