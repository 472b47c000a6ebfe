"""The permutation-LM family (R8): text, the permutation compiler (``compiler.py``)
and the two-stream model (``model.permutation``), with its manifest section.
"""

from __future__ import annotations

from typing import Any

from exactstep.config import RunConfig
from exactstep.families.permutation.compiler import (
    ORDER_TAG,
    PermutationCompiler,
    require_ignore_boundary,
)
from exactstep.families.registry import DEFAULT_SOURCE, Family
from exactstep.model.permutation import build_two_stream


def permutation_compiler(cfg: RunConfig, tokenizer: Any) -> PermutationCompiler:
    """The run's compiler; refuses settings the family cannot honour (``ConfigError``)."""
    require_ignore_boundary(cfg.batch)
    return PermutationCompiler(seed=cfg.seed, predict_one_in=cfg.permutation.predict_one_in)


def permutation_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's ``objective`` section (S1): what identifies the objective (the
    factorisation program, its cutoff and RNG address, the streams, no memory)."""
    k = cfg.permutation.predict_one_in
    return {
        "family": "permutation_lm",
        "shift_owner": "collator",
        "ownership": f"last ceil(free/{k}) tokens of each segment's factorisation order",
        "estimator": "teacher_forced_mle",
        "predict_one_in": k,
        "factorisation": "context tokens first in natural order, then a uniform "
                         "permutation of the free tokens",
        "order_rng": f"numpy PCG64 default_rng([seed, {ORDER_TAG:#x}, epoch, example_id, "
                     "piece]).permutation",
        "positions": "natural",
        "streams": "two_stream (content: ranks <= own; query: ranks < own; shared weights)",
        "memory": "none",
    }


def build_permutation_model(cfg: RunConfig, vocab_size: int) -> Any:
    return build_two_stream(cfg.model, vocab_size, seed=cfg.seed)


FAMILY = Family(name="permutation", model="decoder", data_kind="text",
                default_source=DEFAULT_SOURCE, compiler=permutation_compiler,
                objective=permutation_objective, build_model=build_permutation_model)
