"""The one "packed = separate" measure (R3) every family's model test uses.

A side is ``(logits, loss, grads)``: the per-document logits (a list of tensors, in
the same document order on both sides), the loss, and the gradients by parameter
name. ``equivalence_error`` is the largest absolute difference over all of them;
tests hold it to 1e-5 in fp32 and show a leaky variant exceeding it.

Below it, worst-case rounding bounds (``gamma``, ``matmul_bound``, cross entropy's)
from which tests derive their tolerances instead of observing them.
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


# ---------------------------------------------------------------- rounding bounds
#
# Worst-case bounds of floating-point rounding (Higham, *Accuracy and Stability of
# Numerical Algorithms*, 2nd ed., ch. 3). They hold for any summation order, blocking,
# FMA use or split across threads, so on any CPU and at any thread count: a tolerance
# built from them is derived, not observed. ``unit`` is the unit roundoff, 2**-24 in
# fp32 and 2**-53 in float64; a library ``exp``/``log`` is taken as faithful (< 1 ulp).

FP32_UNIT = 2.0 ** -24
FP64_UNIT = 2.0 ** -53


def gamma(n: int, unit: float = FP32_UNIT) -> float:
    """``n u / (1 - n u)``: the relative error of ``n`` successive roundings. A sum of
    ``n + 1`` terms, in any order, is within ``gamma(n) * sum |terms|`` of the exact sum;
    an inner product of length ``n`` within ``gamma(n) * sum |products|``."""
    return n * unit / (1 - n * unit)


def sum_bound(terms: torch.Tensor, unit: float = FP32_UNIT) -> float:
    """How far a rounded sum of ``terms`` (any order) can be from the exact sum."""
    return gamma(max(terms.numel() - 1, 0), unit) * float(terms.double().abs().sum())


def matmul_bound(a: torch.Tensor, b: torch.Tensor, unit: float = FP32_UNIT) -> torch.Tensor:
    """Entrywise bound of ``|fl(a @ b) - a @ b|``: ``gamma(K) |a| @ |b|``, K inner."""
    return gamma(a.shape[-1], unit) * (a.double().abs() @ b.double().abs())


def cross_entropy_bounds(logits: torch.Tensor, q: torch.Tensor, coeff: torch.Tensor,
                         logit_error: torch.Tensor | float = 0.0, unit: float = FP32_UNIT
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounds of a rounded cross entropy ``-sum_c q_c log softmax(z)_c`` per row.

    ``logits`` [N, V] (the values the rounded logits approximate), ``q`` [N, V] the
    target rows (>= 0; zero rows are unsupervised; an entrywise upper bound of the true
    rows will do), ``coeff`` [N] each row's factor in the objective, ``logit_error`` a
    bound of the logits' own rounding (entrywise or one number). Returns ``(row,
    grad)``: a bound of each ``coeff * loss`` and of each entry of ``coeff * (softmax(z)
    - q)``, the objective's gradient in the logits.

    Derivation, per row: ``lse = m + log S``, ``S = sum_c exp(z_c - m)`` in ``[1, V]``;
    each term errs by at most ``2u exp(x) + u |x| exp(x) <= 2u exp(x) + u/e`` (the
    rounded ``x = z_c - m <= 0``, a faithful ``exp``), the sum by ``gamma(V - 1) S``,
    so ``S`` by ``gamma(2V + 2)`` relatively and ``lse`` by ``gamma(2V + 4) (1 + |lse|)``
    (``log``, then ``+ m``). Then ``log p_c = z_c - lse`` adds ``u |log p_c|`` and the
    ``q``-weighted sum (and smoothing's mix of two such sums) ``gamma(V + 6) sum_c q_c
    |log p_c|``. A logit error ``dz`` (max-norm) moves the loss by at most ``(1 +
    sum q) dz`` and each ``log p_c`` by ``2 dz``, so ``p_c`` by ``expm1(2 dz)`` relatively
    on top of its rounding ``gamma(2V + 6) (1 + |lse|) + 2u |log p_c|``; ``p - q`` and
    the factor round twice more on ``|p - q| <= p + q``."""
    z, q, coeff = logits.double(), q.double(), coeff.double().abs()
    V = z.shape[-1]
    dz = torch.as_tensor(logit_error, dtype=torch.float64).expand_as(z).amax(-1)  # [N]
    lse = torch.logsumexp(z, -1)  # [N]
    logp = (z - lse[:, None]).abs()  # [N, V]: |log p|
    mass = q.sum(-1)  # [N]
    row = (mass * gamma(2 * V + 4, unit) * (1 + lse.abs()) + gamma(V + 6, unit) * (q * logp).sum(-1)
           + (1 + mass) * dz)
    rel = (gamma(2 * V + 6, unit) * (1 + lse.abs())[:, None] + gamma(2, unit) * logp
           + torch.expm1(2 * dz)[:, None])  # [N, V]
    p = z.softmax(-1)
    grad = coeff[:, None] * (p * rel + gamma(2, unit) * (p + q))
    supervised = mass > 0
    return torch.where(supervised, row * coeff, 0.0), torch.where(supervised[:, None], grad, 0.0)


def linear_cross_entropy_bounds(hidden: torch.Tensor, weight: torch.Tensor, q: torch.Tensor,
                                coeff: torch.Tensor, unit: float = FP32_UNIT
                                ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Bounds for ``sum_r coeff_r CE(hidden_r @ weight.T, q_r)`` computed in rounded
    arithmetic from exact ``hidden`` [N, H] and ``weight`` [V, H]: ``(objective,
    d hidden, d weight)``. The logits round by ``matmul_bound``; the weighted sum of N
    rows by ``gamma(N + 1)``; the gradients are the logit gradient ``G`` times
    ``weight`` (inner length V) and ``G.T`` times ``hidden`` (inner length N, any
    chunking): ``dG @ |W| + gamma(V) |G| @ |W|`` and ``dG.T @ |h| + gamma(N) |G|.T @ |h|``."""
    h, w, coeff = hidden.double(), weight.double(), coeff.double()
    z = h @ w.T  # [N, V]
    row, dG = cross_entropy_bounds(z, q, coeff, matmul_bound(h, w.T, unit), unit)
    size = torch.logsumexp(z, -1).abs() + (q.double() * z.abs()).sum(-1)  # >= |loss| [N]
    objective = float(row.sum()) + gamma(h.shape[0] + 1, unit) * float((coeff.abs() * size).sum())
    G = coeff[:, None].abs() * (z.softmax(-1) + q.double())  # >= |coeff (p - q)|
    d_hidden = dG @ w.abs() + gamma(w.shape[0], unit) * (G @ w.abs())
    d_weight = dG.T @ h.abs() + gamma(h.shape[0], unit) * (G.T @ h.abs())
    return objective, d_hidden, d_weight


def smoothed_targets(labels: torch.Tensor, vocab: int, eps: float, ignore_index: int = -100
                     ) -> torch.Tensor:
    """An entrywise upper bound of every smoothing convention's target rows (uniform,
    non_pad, harvard): ``1 - eps`` on the gold class plus ``eps / (V - 2)`` everywhere;
    zero rows for ignored labels. Enough for the bounds above, which use ``q`` only
    through ``|p - q| <= p + q`` and ``sum q = 1`` (here ``<= 1 + eps``: the extra
    ``eps`` mass only loosens them)."""
    supervised = labels != ignore_index
    q = torch.full((labels.shape[0], vocab), eps / (vocab - 2), dtype=torch.float64)
    q[supervised, labels[supervised]] += 1.0 - eps
    return torch.where(supervised[:, None], q, 0.0)


def spread_bound(rounded: torch.Tensor, exact: torch.Tensor, unit: float = FP32_UNIT) -> float:
    """Twice the larger of a rounded result's distance from the same computation in
    float64 (``exact``) and ``u max|exact|`` (rounding the result itself): where no
    closed bound is practical, the yardstick for another rounded computation of the
    same value. Each is that far from ``exact`` if it rounds no worse, so the two are
    within twice it of each other (triangle inequality)."""
    x, e = rounded.detach().double(), exact.detach().double()
    return 2 * max(float((x - e).abs().max()), unit * float(e.abs().max()))


def contract_tolerance(tol: float, rounded: Sequence[torch.Tensor],
                       exact: Sequence[torch.Tensor]) -> float:
    """A contract's fp32 tolerance ``tol`` (R3's 1e-5: packed = separate), or where fp32
    itself cannot promise it, twice a reference's own distance from the same computation
    in float64 (``spread_bound``, the largest over its tensors). The contract holds where
    fp32 rounds two orders below it, as on the tests' small shapes; the test measures
    that instead of assuming it."""
    return max(tol, *(spread_bound(r, e) for r, e in zip(rounded, exact, strict=True)))


def equivalence_tolerance(tol: float, separate: Side, exact: Side) -> float:
    """``contract_tolerance`` for ``equivalence_error``: ``tol``, or twice the separate
    side's own distance from the same side computed in float64 (``exact``)."""
    def tensors(side: Side) -> list[torch.Tensor]:
        logits, loss, grads = side
        return [*(x for x in logits if x.numel()), torch.as_tensor(loss),
                *(grads[n] for n in sorted(grads))]
    return contract_tolerance(tol, tensors(separate), tensors(exact))
