"""The chat SFT family (R5, R8): conversations (the built-in arithmetic demo by default),
the causal compiler over rendered chats, assistant-owned targets, and greedy exact match
on the demo's held-out conversations.
"""

from __future__ import annotations

from typing import Any

from exactstep.config import RunConfig
from exactstep.data.chat import template_for
from exactstep.eval import greedy_answer_accuracy
from exactstep.families.causal.family import build_decoder, causal_compiler
from exactstep.families.registry import Family, FamilyParts


def chat_objective(cfg: RunConfig) -> dict[str, Any]:
    return {"family": "chat_sft", "shift_owner": "collator",
            "ownership": "assistant_targets", "estimator": "teacher_forced_mle"}


def chat_score(model: Any, parts: FamilyParts, cfg: RunConfig, device: Any) -> dict[str, Any]:
    """Greedy exact match on the built-in demo's held-out conversations (none for a
    user's chat data, which has no checkable answer)."""
    conversations = parts.data.heldout_conversations
    if conversations is None:
        return {}
    accuracy = greedy_answer_accuracy(
        model, parts.tokenizer, conversations, device=device,
        max_new_tokens=cfg.arith.max_new_tokens, template=template_for(parts.tokenizer))
    return {"exact_match": accuracy, "exact_match_n": len(conversations),
            "exact_match_of": "held-out conversations"}


FAMILY = Family(name="chat", model="decoder", data_kind="chat", default_source="arith",
                compiler=causal_compiler, objective=chat_objective, build_model=build_decoder,
                score=chat_score)
