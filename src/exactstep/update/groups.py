"""Parameter groups and the optimizer (U6).

``resolve_groups`` assigns every unique trainable parameter (a tied embedding/head
once) to exactly one of ``decay`` / ``no_decay`` by one declared rule and hashes the
result for the manifest (S1); ``build_optimizer`` builds the optimizer on those
groups. Weight decay follows PyTorch's convention, with converters to the paper's.
Design and derivations: docs/design/update.md#updategroupspy (U6, S1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from exactstep.errors import ConfigError
from exactstep.update.config import UpdateConfig

DECAY = "decay"
NO_DECAY = "no_decay"


@dataclass(frozen=True)
class ResolvedGroups:
    """The resolved assignment of unique parameters to optimizer groups (U6).

    ``param_groups`` is ready for ``torch.optim`` (each dict has ``params``,
    ``weight_decay`` and ``name``; empty groups are omitted). ``table`` has one
    row per unique parameter: ``name``, ``group``, ``shape``, ``numel``, and
    ``aliases`` (other names of the same tensor, e.g. a tied head). ``digest`` is
    the sha256 of the canonical JSON of the table and each group's decay.
    """

    param_groups: list[dict]
    digest: str
    table: list[dict]

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Unique trainable parameters, in table order (the clip set of U3)."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def numel(self) -> int:
        return sum(row["numel"] for row in self.table)


def resolve_groups(model: nn.Module, cfg: UpdateConfig) -> ResolvedGroups:
    """Assign every unique trainable parameter of ``model`` to one group (U6).

    ``decay``: tensors of two or more dimensions except embeddings; ``no_decay``:
    one-dimensional tensors and, unless ``update.decay_embeddings``, ``nn.Embedding``
    weights. Uniqueness is by identity: a tied parameter is listed once, under the name
    PyTorch reports first, its other names in ``aliases``. Raises ``ConfigError`` when the model has no trainable parameter.
    """
    embedding_ids = {
        id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)
    }
    aliases = _aliases_by_identity(model)
    members: dict[str, list[nn.Parameter]] = {DECAY: [], NO_DECAY: []}
    table: list[dict] = []
    for name, param in model.named_parameters():  # de-duplicated by identity
        if not param.requires_grad:
            continue
        group = _group_of(param, is_embedding=id(param) in embedding_ids, cfg=cfg)
        members[group].append(param)
        table.append(
            {
                "name": name,
                "group": group,
                "shape": list(param.shape),
                "numel": param.numel(),
                "aliases": [a for a in aliases[id(param)] if a != name],
            }
        )
    if not table:
        raise ConfigError("the model has no trainable parameter; nothing to optimize")
    decay_of = {DECAY: cfg.weight_decay, NO_DECAY: 0.0}
    param_groups = [
        {"params": members[g], "weight_decay": decay_of[g], "name": g}
        for g in (DECAY, NO_DECAY)
        if members[g]
    ]
    return ResolvedGroups(param_groups=param_groups, digest=_digest(table, decay_of), table=table)


def build_optimizer(
    model: nn.Module, cfg: UpdateConfig
) -> tuple[torch.optim.Optimizer, ResolvedGroups]:
    """AdamW (PyTorch's decoupled convention), SGD with momentum, or Adafactor.

    AdamW uses the fused kernel when every parameter lives on a device that has
    one (CPU and CUDA): it reads no host value during ``step`` (U7).
    """
    groups = resolve_groups(model, cfg)
    if cfg.optimizer == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            groups.param_groups,
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            **_fast_kernel(groups.parameters),
        )
    elif cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            groups.param_groups,
            lr=cfg.lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            **_fast_kernel(groups.parameters, "sgd"),
        )
    elif cfg.optimizer == "adafactor":
        optimizer = torch.optim.Adafactor(
            groups.param_groups, lr=cfg.lr, weight_decay=cfg.weight_decay
        )
    else:  # pragma: no cover - UpdateConfig's Literal forbids it
        raise ConfigError(
            f"update.optimizer must be adamw, sgd or adafactor; got {cfg.optimizer!r}"
        )
    return optimizer, groups


def torch_to_paper_weight_decay(weight_decay_torch: float, lr: float) -> float:
    """PyTorch's ``weight_decay`` -> the paper's per-step decay: ``lr * wd`` (U6)."""
    return lr * weight_decay_torch


def paper_to_torch_weight_decay(weight_decay_paper: float, lr: float) -> float:
    """The paper's per-step decay -> PyTorch's ``weight_decay``: ``wd / lr`` (U6)."""
    if not lr > 0:
        raise ConfigError(f"converting weight decay needs lr > 0; got {lr}")
    return weight_decay_paper / lr


def _group_of(param: nn.Parameter, *, is_embedding: bool, cfg: UpdateConfig) -> str:
    if param.ndim < 2:
        return NO_DECAY
    if is_embedding and not cfg.decay_embeddings:
        return NO_DECAY
    return DECAY


def _aliases_by_identity(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def _digest(table: list[dict], decay_of: dict[str, float]) -> str:
    canonical = json.dumps(
        {"table": table, "weight_decay": decay_of}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def _fast_kernel(params: list[nn.Parameter], optimizer: str = "adamw") -> dict:
    """``fused`` where every parameter allows it. DTensor parameters (FSDP2, tensor
    parallel) have a sharding rule for the fused AdamW kernel but none for fused SGD:
    SGD over them takes the ``foreach`` kernels, which DTensor shards op by op."""
    devices = {p.device.type for p in params}
    dtypes = {p.dtype for p in params}
    floating = all(d.is_floating_point for d in dtypes)
    distributed = any(hasattr(p, "placements") for p in params)
    if optimizer == "sgd" and distributed:
        return {"foreach": True}
    if floating and devices <= {"cpu", "cuda"}:
        return {"fused": True}
    return {}
