"""``train.compile``: ``torch.compile`` of a model's forward, where exactstep allows it.

The built-in decoder compiles each block; a Hugging Face causal LM compiles its
decoder stack. Visibility, RoPE tables, the 4D mask, the chunked loss and the window
stay eager. Modules are compiled in place (``nn.Module.compile``), so parameters and
``state_dict`` names are the eager ones and a checkpoint moves between compiled and
eager runs (S2). Other models are refused with a ``ConfigError``.
Design and derivations: docs/design/model.md#modelcompiledpy (S9, S5).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from exactstep.errors import ConfigError
from exactstep.model.decoder import Decoder
from exactstep.model.hf import HFCausalLM


def compile_model(model: nn.Module, *, family: str) -> list[nn.Module]:
    """Compile ``model``'s forward in place; returns the modules compiled.

    ``Decoder`` (exactly: the built-in decoder and encoder): every block, each a graph
    of norms, projections, RoPE, attention and MLP; ``HFCausalLM``: its decoder stack
    (``input_ids``, positions and the prepared mask in, hidden states out). Anything
    else (the permutation LM's two streams, the encoder-decoder) is a ``ConfigError``
    naming ``train.compile`` and ``family``. ``dynamic=None``: shapes are static
    until one changes (the segments path's buckets), then PyTorch makes them dynamic.
    """
    targets: list[nn.Module]
    if type(model) is Decoder:
        targets = list(model.layers)
    elif isinstance(model, HFCausalLM):
        targets = [model.decoder]
    else:
        raise ConfigError(
            f"train.compile = true is not available for objective.family = {family!r} "
            f"(its model, {type(model).__name__}, is not compiled by exactstep); set "
            "train.compile = false"
        )
    for module in targets:
        module.compile(**compile_options())
    return targets


def compile_options() -> dict[str, Any]:
    """The ``torch.compile`` options every compiled module gets (recorded in the docs)."""
    return {"backend": "inductor", "dynamic": None, "fullgraph": False}
