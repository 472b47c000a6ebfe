"""The one "packed = separate" measure (R3) every family's model test uses.

A side is ``(logits, loss, grads)``: the per-document logits (a list of tensors, in
the same document order on both sides), the loss, and the gradients by parameter
name. ``equivalence_error`` is the largest absolute difference over all of them;
tests hold it to 1e-5 in fp32 and show a leaky variant exceeding it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Side = tuple[Sequence[torch.Tensor], torch.Tensor, Mapping[str, torch.Tensor]]


def equivalence_error(packed: Side, separate: Side) -> float:
    """Max |packed - separate| over per-document logits, the loss and every gradient
    (a document with no logits, e.g. one without a predicted column, is skipped)."""
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = packed, separate
    assert set(grads_a) == set(grads_b), "both sides must have the same parameters"
    errors = [float((a - b).abs().max())
              for a, b in zip(logits_a, logits_b, strict=True) if a.numel()]
    errors.append(float((loss_a - loss_b).abs()))
    errors += [float((grads_a[n] - grads_b[n]).abs().max()) for n in grads_a]
    return max(errors)
