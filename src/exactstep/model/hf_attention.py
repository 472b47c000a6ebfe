"""``attn_implementation = "exactstep"``: HF attention per document, no dense mask (R3, U7).

Registered with transformers' ``AttentionInterface`` (the attention) and
``AttentionMaskInterface`` (the mask, which HF builds nowhere during a packed
forward); ``HFCausalLM`` hands each forward's ``Visibility`` (``model.attention``'s
per-document SDPA on CPU, FlexAttention on CUDA) to every layer as a keyword. HF's
own calls without it (a document alone) run HF's ``sdpa`` unchanged.
Design and derivations: docs/design/model.md#hf-exactstep-attention (R3, U7).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import torch

from exactstep.errors import ModelError
from exactstep.model.attention import Visibility, attend

#: the ``attn_implementation`` name exactstep registers with transformers
NAME = "exactstep"
#: the keyword that carries a forward's ``Visibility`` to every attention call
VISIBILITY_KEYWORD = "exactstep_visibility"

#: config attributes naming attention features the per-document path cannot apply,
#: with their names; a value in the tuple is neutral (the feature is off)
UNSUPPORTED: tuple[tuple[str, str, tuple], ...] = (
    ("attn_logit_softcapping", "attention logit soft-capping", (None, 0, 0.0)),
    ("attention_dropout", "attention dropout", (None, 0, 0.0)),
    ("attn_pdrop", "attention dropout", (None, 0, 0.0)),
    ("attention_probs_dropout_prob", "attention dropout", (None, 0, 0.0)),
)

#: set while ``HFCausalLM`` runs a packed forward: HF's mask builders return None
PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("exactstep_packed", default=False)


def register(transformers: Any) -> None:
    """Make ``NAME`` an attention implementation of ``transformers`` (idempotent)."""
    transformers.AttentionInterface.register(NAME, attention)
    transformers.masking_utils.AttentionMaskInterface.register(NAME, mask)


@contextlib.contextmanager
def packed_forward() -> Iterator[None]:
    """While open, HF's mask builders build nothing for ``NAME`` (the ``Visibility``
    keyword carries the documents); closed, they build ``sdpa``'s mask."""
    token = PACKED.set(True)
    try:
        yield
    finally:
        PACKED.reset(token)


def mask(**kwargs: Any) -> torch.Tensor | None:
    """HF's mask for ``NAME``: none inside ``packed_forward``, else ``sdpa``'s."""
    if PACKED.get():
        return None
    from transformers.masking_utils import sdpa_mask  # lazy: transformers is an extra

    return sdpa_mask(**kwargs)


def config_refusal(config: Any) -> str | None:
    """What of ``UNSUPPORTED`` the config turns on (attention logit soft-capping,
    attention dropout), or None."""
    for attribute, feature, neutral in UNSUPPORTED:
        value = getattr(config, attribute, None)
        if value not in neutral:
            return f"{feature} ({attribute} = {value})"
    return None


def refusal(config: Any, model: torch.nn.Module) -> str | None:
    """Why ``NAME`` cannot run this model exactly, or None: attention logit
    soft-capping, attention dropout or attention sinks (a parameter named ``sinks``)."""
    found = config_refusal(config)
    if found is not None:
        return found
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        return "attention sinks (a parameter named sinks)"
    return None


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention signature: ``[B, nH, T, Dh]`` query, ``[B, nKV, T, Dh]`` key and
    value -> ``([B, T, nH, Dh], None)``.

    With the ``VISIBILITY_KEYWORD``: each query sees the keys its ``Visibility``
    allows (``attention.attend``), keys and values repeated over the query groups
    (GQA), queries scaled by ``scaling``. Anything it cannot apply (a mask, dropout,
    soft-capping, sinks, a position bias, a key cache) is one ``ModelError``.
    Without it: HF's ``sdpa_attention_forward`` with the same arguments.
    """
    vis: Visibility | None = kwargs.pop(VISIBILITY_KEYWORD, None)
    if vis is None:
        if PACKED.get():
            raise ModelError(unsupported_message(
                type(module).__name__, "a decoder that does not pass its keywords on to "
                "its attention, so exactstep's per-document visibility never reaches it"))
        from transformers.integrations.sdpa_attention import (  # lazy: transformers is an extra
            sdpa_attention_forward,
        )

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    check_call(module, query, key, value, attention_mask, dropout, kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # [B, nKV, T, Dh] -> [B, nH, T, Dh], each kv head once per query group
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    factor = 1.0 if scaling is None else scaling * math.sqrt(query.shape[-1])
    if not changes_nothing(factor, query.dtype):  # attend scales by 1/sqrt(Dh)
        query = query * factor
    out = attend(query, key, value, vis)  # [B, nH, T, Dh]
    return out.transpose(1, 2).contiguous(), None


def changes_nothing(factor: float, dtype: torch.dtype) -> bool:
    """Whether multiplying a ``dtype`` tensor by the Python float ``factor`` leaves every
    value as it is: ``factor`` is exactly 1 in the precision PyTorch multiplies in
    (float32 for float32, bfloat16 and float16; float64 for float64). HF's
    ``head_dim ** -0.5`` times ``sqrt(head_dim)`` is ``1 + 2**-52`` for head
    dimensions 8, 32 and 128 (Llama's): 1 in float32, so no multiplication is
    spent on it, forward and backward."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(factor, dtype=compute).item() == 1.0


def check_call(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, attention_mask: Any, dropout: float,
               kwargs: dict[str, Any]) -> None:
    """One ``ModelError`` for what the per-document path cannot apply."""
    found = []
    if attention_mask is not None:
        found.append("an attention mask of its own")
    if dropout:
        found.append(f"attention dropout ({dropout})")
    for name, what in (("softcap", "attention logit soft-capping"), ("s_aux", "attention sinks"),
                       ("sinks", "attention sinks"), ("position_bias", "a position bias")):
        if kwargs.get(name) is not None:
            found.append(what)
    if key.shape[2] != query.shape[2]:
        found.append("keys beyond its queries (a cache or cross-attention)")
    if key.shape[-1] != value.shape[-1] or key.shape[-1] != query.shape[-1]:
        found.append("values or keys of another head dimension than its queries")
    if query.shape[1] % key.shape[1]:
        found.append("query heads that are not a multiple of its key heads")
    if found:
        raise ModelError(unsupported_message(type(module).__name__, ", ".join(found)))


def unsupported_message(where: str, what: str) -> str:
    return (f"attn_implementation {NAME!r} cannot run {where}: it needs {what}, which "
            "exactstep's per-document attention does not apply (R3); set "
            "model.attn_implementation = 'sdpa'")
