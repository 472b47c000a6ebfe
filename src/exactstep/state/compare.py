"""Bit-for-bit comparison of training states (S5).

``state_differences`` names every path where two nested states (parameters,
optimizer state, RNG, counters) are not bitwise identical: what the resume
equivalence tests assert on.
Design and derivations: docs/design/state.md#statecomparepy (S5).
"""

from __future__ import annotations

from typing import Any

import torch


def state_differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Dotted paths where ``a`` and ``b`` are not bitwise identical; ``[]`` if equal.

    Walks dicts, lists, tuples, tensors and plain values. A tensor differs if its
    dtype, shape or any byte differs (``-0.0`` vs ``0.0`` and two NaN payloads differ,
    which ``torch.equal`` would hide); a plain value if its type or value differs
    (``1`` vs ``1.0``).
    """
    out: list[str] = []
    _walk(a, b, path, out)
    return out


def tensors_bitwise_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (devices may differ)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    return torch.equal(_bytes_of(x), _bytes_of(y))


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().cpu().contiguous().reshape(-1)  # [numel]
    if flat.dtype == torch.bool:
        return flat.to(torch.uint8)
    return flat.view(torch.uint8)  # [numel * itemsize]


def _walk(a: Any, b: Any, path: str, out: list[str]) -> None:
    here = path or "<root>"
    if type(a) is not type(b):
        out.append(f"{here} (type {type(a).__name__} vs {type(b).__name__})")
        return
    if isinstance(a, torch.Tensor):
        if not tensors_bitwise_equal(a, b):
            out.append(here)
        return
    if isinstance(a, dict):
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                out.append(f"{sub} (missing on one side)")
            else:
                _walk(a[key], b[key], sub, out)
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{here} (length {len(a)} vs {len(b)})")
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _walk(x, y, f"{path}.{i}" if path else str(i), out)
        return
    if isinstance(a, float) and a != a and b != b:  # NaN == NaN for plain floats
        return
    if a != b:
        out.append(here)
