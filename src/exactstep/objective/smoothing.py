"""Label-smoothing conventions, named and never mixed (L2).

``Smoothing.resolve`` validates one of ``uniform``, ``non_pad`` or ``harvard``: each
puts ``1 - eps`` on the gold class and spreads ``eps`` over its own support of
classes. The row losses (``objective.cross_entropy``) use it without building the
target ``q``; ``target_distribution`` builds ``q`` densely for tests and inspection.
Design and derivations: docs/design/objective.md#objectivesmoothingpy (L2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from exactstep.errors import ObjectiveError

Convention = Literal["uniform", "non_pad", "harvard"]
CONVENTIONS: tuple[str, ...] = ("uniform", "non_pad", "harvard")


@dataclass(frozen=True)
class Smoothing:
    """A validated smoothing setting for a vocabulary of ``vocab_size`` classes.

    Construct with ``Smoothing.resolve``; the constructor does not validate. The target
    is ``q = (1 - eps) * onehot(gold) + eps * uniform(S)`` with support ``S``: every
    class (``uniform``), every class but pad (``non_pad``), every class but gold and
    pad (``harvard``; every class but gold when gold is pad).
    """

    convention: Convention
    eps: float
    vocab_size: int
    pad_id: int | None

    @staticmethod
    def resolve(convention: str, eps: float, vocab_size: int, pad_id: int | None) -> Smoothing:
        """Validate a smoothing setting (L2).

        Raises ``ObjectiveError`` for an unknown convention, ``eps`` outside [0, 1],
        ``non_pad``/``harvard`` without a pad id or with a pad id outside the vocabulary,
        and ``harvard`` with ``V < 3`` (its support ``V - 2`` would be empty). The checks
        apply even at ``eps = 0`` so that a declared convention is always realisable.
        """
        if convention not in CONVENTIONS:
            raise ObjectiveError(
                f"objective.smoothing must be one of {', '.join(CONVENTIONS)}; got {convention!r}"
            )
        if not 0.0 <= eps <= 1.0:
            raise ObjectiveError(f"objective.label_smoothing must be in [0, 1]; got {eps}")
        if vocab_size < 1:
            raise ObjectiveError(f"the vocabulary must have at least one class; got V={vocab_size}")
        if convention != "uniform":
            if pad_id is None:
                raise ObjectiveError(
                    f"objective.smoothing={convention} needs the tokenizer's pad id; "
                    "use smoothing=uniform or a tokenizer with a pad token"
                )
            if not 0 <= pad_id < vocab_size:
                raise ObjectiveError(
                    f"pad id {pad_id} is outside the vocabulary [0, {vocab_size}); "
                    f"objective.smoothing={convention} cannot exclude it"
                )
        if convention == "non_pad" and vocab_size < 2:
            raise ObjectiveError("objective.smoothing=non_pad needs V >= 2; use uniform")
        if convention == "harvard" and vocab_size < 3:
            raise ObjectiveError(
                f"objective.smoothing=harvard needs V >= 3 (got V={vocab_size}); "
                "use non_pad or uniform"
            )
        return Smoothing(convention, float(eps), vocab_size, pad_id)  # type: ignore[arg-type]

    @property
    def active(self) -> bool:
        return self.eps > 0.0

    def support_size(self, gold_N: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``|S|`` per row in ``dtype``, same device as ``gold_N`` (no host sync)."""
        V = self.vocab_size
        if self.convention == "harvard":
            gold_is_pad = gold_N == self.pad_id
            return torch.where(gold_is_pad, float(V - 1), float(V - 2)).to(dtype)
        size = V if self.convention == "uniform" else V - 1
        return torch.full(gold_N.shape, float(size), dtype=dtype, device=gold_N.device)

    def support_sum(
        self, z_nV: torch.Tensor, gold_n: torch.Tensor, z_gold_n: torch.Tensor
    ) -> torch.Tensor:
        """``sum(z[S])`` per row for fp32 logits ``z_nV`` [n, V]."""
        total = z_nV.sum(dim=1)  # [n]
        if self.convention == "uniform":
            return total
        total = total - z_nV[:, self.pad_id]
        if self.convention == "non_pad":
            return total
        gold_is_pad = gold_n == self.pad_id
        return total - torch.where(gold_is_pad, torch.zeros_like(z_gold_n), z_gold_n)

    def subtract_target(
        self, dz_nV: torch.Tensor, gold_n: torch.Tensor, scale_n: torch.Tensor
    ) -> None:
        """In place: ``dz -= scale * q`` for each row (``q`` never materialised).

        ``gold_n`` must be a valid class index on every row; ``scale_n`` [n] is the
        row's weight (0 on ignored rows, which then keep whatever ``dz`` holds: the
        caller has already scaled them to 0).
        """
        eps = self.eps
        if eps > 0.0:
            share_n = scale_n * (eps / self.support_size(gold_n, dz_nV.dtype))  # [n]
            dz_nV.sub_(share_n.unsqueeze(1))
            if self.convention != "uniform":
                dz_nV[:, self.pad_id] += share_n  # pad is never in S
        gold_adjust_n = scale_n * -(1.0 - eps)
        if eps > 0.0 and self.convention == "harvard":
            # the gold class is not in S either, unless it is pad (restored just above)
            gold_adjust_n = gold_adjust_n + torch.where(gold_n == self.pad_id, 0.0, share_n)
        dz_nV.scatter_add_(1, gold_n.unsqueeze(1), gold_adjust_n.unsqueeze(1))


def target_distribution(smoothing: Smoothing, gold: int) -> torch.Tensor:
    """The dense target ``q`` [V] (float64) of one row with gold class ``gold``."""
    V = smoothing.vocab_size
    excluded = set()
    if smoothing.convention in ("non_pad", "harvard"):
        excluded.add(smoothing.pad_id)
    if smoothing.convention == "harvard" and gold != smoothing.pad_id:
        excluded.add(gold)
    support = [c for c in range(V) if c not in excluded]
    q = torch.zeros(V, dtype=torch.float64)
    q[support] = smoothing.eps / len(support)
    q[gold] += 1.0 - smoothing.eps
    return q
