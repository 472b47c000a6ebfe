"""LoRA adapters through ``peft``, shared by the built-in decoder and HF models (H4).

``lora_config`` turns ``model.lora`` into peft's ``LoraConfig``; ``adapting`` runs
peft's injection with the adapters' random init drawn from the run's seed only, every
global RNG stream left as it was (S5). With adapters only they are trainable (U6),
and a checkpoint holds them alone (``adapter_state`` / ``load_adapter_state``, S2):
the base is rebuilt from its source and pinned by its digest (``lora_section``, S1,
S4). ``merged_state`` is a LoRA model's state with the adapters folded into the base
(what a merged export writes). ``BaseWithoutAdapters`` is a LoRA model's frozen base
as a second policy (a policy's KL reference): the same weights with the adapters off.
Design and derivations: docs/design/model.md#model-lora (H4, U6, S2, S5).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from exactstep.errors import ModelError
from exactstep.model.config import LoRAConfig
from exactstep.state.rng import isolated_rng

#: Why the module whose weight is the head takes no adapter (H4 with L1).
HEAD_TARGETED = ("model.lora.target_modules names the output head; exactstep fuses the "
                 "plain head weight into its loss (L1), so the head takes no adapter")


def import_peft() -> Any:
    try:
        import peft  # lazy: an optional extra, needed only with model.lora.r > 0
    except ImportError:
        raise ModelError("model.lora needs peft: pip install 'exactstep[hf]'") from None
    return peft


def lora_config(lora: LoRAConfig, targets: str | list[str] | None = None, **extra: Any) -> Any:
    """peft's ``LoraConfig`` for ``model.lora`` (``targets`` replaces its target list)."""
    return import_peft().LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=lora.targets if targets is None else targets, bias=lora.bias, **extra)


def inject_adapters(config: Any, model: nn.Module) -> nn.Module:
    """peft's ``inject_adapter_in_model``: ``model`` keeps its class and forward, its
    target layers become peft LoRA layers, and only the adapters stay trainable."""
    return import_peft().inject_adapter_in_model(config, model)


@contextlib.contextmanager
def adapting(seed: int) -> Iterator[None]:
    """Around peft's injection: the adapters' init draws from the global generator seeded
    with ``seed``, and every global stream is restored afterwards (S5); peft's warnings
    are silenced and its ``ValueError`` (a target the model lacks) becomes a
    ``ModelError`` naming ``model.lora.target_modules``."""
    try:
        with isolated_rng(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.default_generator.manual_seed(seed)
            yield
    except ValueError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelError(f"model.lora.target_modules: {first}") from None


def adapted(module: nn.Module | None) -> bool:
    """Whether peft put adapters on ``module``."""
    return module is not None and hasattr(module, "lora_A")


def adapter_names(model: nn.Module) -> set[str]:
    """The state-dict names of ``model``'s trainable tensors: with LoRA, the adapters."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a LoRA model's checkpoint holds (S2, H4): its adapters only."""
    names = adapter_names(model)
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``adapter_state``'s tensors (a whole state dict loads too): only frozen base
    tensors may be absent; a state without adapters (a plain model's), an adapter
    missing or a tensor the model lacks is a ``ModelError``."""
    adapters = adapter_names(model)
    if not adapters & set(state):
        raise ModelError(
            "the checkpoint holds no LoRA adapters (a run without model.lora, e.g. the parent "
            "of a warm start): a LoRA run rebuilds its base from the model's source and seed, "
            "never from another run's weights; export that run (exactstep export) and train "
            "adapters on it with model.source = 'hf' and model.path = the export")
    missing, unexpected = model.load_state_dict(state, strict=False)
    lacking = sorted(set(missing) & adapters)
    if unexpected or lacking:
        raise ModelError(f"the checkpoint does not fit the LoRA model: "
                         f"{len(unexpected)} unexpected tensor(s) {sorted(unexpected)[:2]}, "
                         f"{len(lacking)} adapter tensor(s) missing {lacking[:2]}")


def lora_section(model: nn.Module, base_digest: str | None) -> dict[str, Any]:
    """The manifest's ``model.lora`` (S1, H4): the frozen base's digest (its weights
    before the adapters were added), the adapters' parameter count and peft's version."""
    return {
        "base_weights_sha256": base_digest,
        "adapter_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peft": import_peft().__version__,
    }


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, ``model`` computes its frozen base: an HF model's ``PeftModel`` under
    peft's ``disable_adapter()``; an injected model with each peft LoRA layer's adapters
    disabled (what ``disable_adapter`` does), each layer's state restored after."""
    inner = getattr(model, "module", model)
    peft_model = getattr(inner, "hf", None)
    if callable(getattr(peft_model, "disable_adapter", None)):
        with peft_model.disable_adapter():
            yield
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in inner.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ModelError("the model holds no LoRA adapters to disable; its base is the "
                         "model itself")
    states = [m.disable_adapters for m in layers]
    try:
        for m in layers:
            m.enable_adapters(False)
        yield
    finally:
        for m, disabled in zip(layers, states, strict=True):
            m.enable_adapters(not disabled)


class BaseWithoutAdapters:
    """A LoRA model's frozen base seen as a model (``forward``, ``logits``): the very
    same module with its adapters disabled for each call, holding no weights of its own
    (never a second copy, never trainable state)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = getattr(model, "module", model)

    def __call__(self, batch: Any) -> torch.Tensor:
        with adapters_disabled(self.model):
            return self.model(batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with adapters_disabled(self.model):  # the head takes no adapter (HEAD_TARGETED)
            return self.model.logits(hidden)

    def modules(self) -> Iterator[nn.Module]:
        return self.model.modules()

    def eval(self) -> BaseWithoutAdapters:
        self.model.eval()
        return self


def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every adapter merged into its base layer by peft
    (``W + (alpha / r) B A``), under the names the model has without LoRA; the model
    itself is left as it is (the merge happens on a copy)."""
    peft = import_peft()
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, peft.tuners.lora.LoraLayer):
            module.merge()
    return {k.replace(".base_layer.", "."): v for k, v in twin.state_dict().items()
            if ".lora_" not in k}
