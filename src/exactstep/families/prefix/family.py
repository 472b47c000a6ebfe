"""The prefix-LM family (R8): chat data, the prefix compiler (``compiler.py``), the built-in
decoder with a bidirectional prompt, and greedy exact match decoded with the prefix the
training rows had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exactstep.config import RunConfig
from exactstep.data.chat import template_for
from exactstep.errors import ConfigError
from exactstep.eval import greedy_answer_accuracy
from exactstep.families.causal.family import build_decoder
from exactstep.families.prefix.compiler import PREFIX, PrefixCompiler, prompt_length
from exactstep.families.registry import Family, FamilyParts
from exactstep.rows.chat import chat_example


def prefix_compiler(cfg: RunConfig, tokenizer: Any) -> PrefixCompiler:
    return PREFIX


def prefix_objective(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's ``objective`` section (S1) for the family."""
    return {"family": "prefix_lm", "shift_owner": "collator",
            "ownership": "continuation_targets", "prefix": "tokens_before_first_target",
            "visibility": "bidirectional_prefix_causal_continuation",
            "estimator": "teacher_forced_mle"}


def build_prefix_decoder(cfg: RunConfig, vocab_size: int) -> Any:
    """The built-in decoder; a Hugging Face model cannot take a bidirectional prefix."""
    if cfg.model.source != "builtin":
        raise ConfigError(
            "objective.family = 'prefix' needs the built-in decoder (a Hugging Face causal "
            "LM cannot attend bidirectionally over a prefix); set model.source = 'builtin'"
        )
    return build_decoder(cfg, vocab_size)


def prefix_score(model: Any, parts: FamilyParts, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """Greedy exact match on the built-in demo's held-out conversations, decoded with
    the prefix the training rows had: each conversation is compiled as a training
    example (same template, policy and row length), its ``prompt_length`` is the
    decoding row's bidirectional prefix (at most the prompt), everything after it is
    causal. None for a user's chat data (no checkable answer)."""
    conversations = parts.data.heldout_conversations
    if conversations is None:
        return {}
    template = template_for(parts.tokenizer)
    policy = cfg.chat

    def prefix_of(conversation: Any, prompt: Sequence[int]) -> int:
        example = chat_example(conversation, 0, parts.tokenizer, policy,
                               max_len=cfg.batch.seq_len, template=template)
        return len(prompt) if example is None else min(prompt_length(example), len(prompt))

    accuracy = greedy_answer_accuracy(
        model, parts.tokenizer, conversations, device=device,
        max_new_tokens=cfg.arith.max_new_tokens, template=template,
        prefix_of=prefix_of)
    return {"exact_match": accuracy, "exact_match_n": len(conversations),
            "exact_match_of": "held-out conversations"}


FAMILY = Family(name="prefix", model="decoder", data_kind="chat", default_source="arith",
                compiler=prefix_compiler, objective=prefix_objective,
                build_model=build_prefix_decoder, score=prefix_score)
