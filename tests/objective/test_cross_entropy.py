"""Chunked fp32 cross entropy with the head fused in (L1) and smoothing conventions (L2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import (
    FP64_UNIT,
    cross_entropy_bounds,
    linear_cross_entropy_bounds,
    matmul_bound,
    smoothed_targets,
)
from torch.utils._python_dispatch import TorchDispatchMode

from exactstep.errors import ConfigError, ObjectiveError
from exactstep.objective import (
    ObjectiveConfig,
    Smoothing,
    fused_row_losses,
    fused_weighted_sum,
    logits_row_losses,
)
from exactstep.objective import cross_entropy as ce_module
from exactstep.objective import reference as ref
from exactstep.rows.batch import IGNORE_INDEX

N, V, H = 50, 13, 8


def make_case(seed: int = 0, dtype=torch.float32, ignore_every: int = 4):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_(True)
    weight = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::ignore_every] = IGNORE_INDEX
    row_weights = torch.rand(N, generator=g, dtype=dtype)
    return hidden, weight, labels, row_weights


def grads_of(scalar, *tensors):
    return torch.autograd.grad(scalar, tensors)


def bounds(hidden, weight, labels, coeff, eps: float = 0.0, unit: float = 2.0 ** -24):
    """Worst-case rounding bounds (``tests/equivalence.py``) of ``sum_r coeff_r CE_r``
    from ``hidden @ weight.T`` and of its two gradients, for any chunking or order: a
    path is within them of the exact value, two paths within twice them of each other."""
    q = smoothed_targets(labels, weight.shape[0], eps, IGNORE_INDEX)
    return linear_cross_entropy_bounds(hidden.detach(), weight.detach(), q, coeff, unit)


def supervised(labels, scale=1.0) -> torch.Tensor:
    return (labels != IGNORE_INDEX).double() * scale


def row_bounds(hidden, weight, labels, eps: float = 0.0, unit: float = 2.0 ** -24):
    """The same bound for each row's loss (``coeff = 1``)."""
    q = smoothed_targets(labels, weight.shape[0], eps, IGNORE_INDEX)
    h, w = hidden.detach().double(), weight.detach().double()
    return cross_entropy_bounds(h @ w.T, q, torch.ones(len(labels), dtype=torch.float64),
                                matmul_bound(h, w.T, unit), unit)[0]


def within(a, b, bound) -> bool:
    """``|a - b| <= bound`` entrywise (float64)."""
    return bool(((a.double() - b.double()).abs() <= bound).all())


# --------------------------------------------------------- uniform == PyTorch's


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.37, 1.0])
def test_uniform_matches_torch_cross_entropy(eps):
    """Within twice the worst-case fp32 rounding bound of the token mean (both paths
    round, each within the bound of the exact value): ~5e-5 here, 100x the usual gap."""
    hidden, weight, labels, _ = make_case()
    cfg = ObjectiveConfig(label_smoothing=eps, chunk_rows=7)
    ce, _ = fused_row_losses(hidden, weight, labels, cfg, pad_id=None)
    ours = ce.sum() / (labels != IGNORE_INDEX).sum()
    theirs = F.cross_entropy(hidden @ weight.T, labels, label_smoothing=eps)
    loss_bound, *grad_bounds = bounds(hidden, weight, labels,
                                      supervised(labels, 1 / int((labels != IGNORE_INDEX).sum())), eps)
    assert abs(ours.item() - theirs.item()) <= 2 * loss_bound
    for a, b, bound in zip(grads_of(ours, hidden, weight), grads_of(theirs, hidden, weight),
                           grad_bounds, strict=True):
        assert within(a, b, 2 * bound)


def test_uniform_check_catches_other_conventions():
    """Negative control: the same comparison fails for non_pad and harvard."""
    hidden, weight, labels, _ = make_case()
    theirs = F.cross_entropy(hidden @ weight.T, labels, label_smoothing=0.1)
    loss_bound, _, _ = bounds(hidden, weight, labels,
                              supervised(labels, 1 / int((labels != IGNORE_INDEX).sum())), 0.1)
    for convention in ("non_pad", "harvard"):
        cfg = ObjectiveConfig(smoothing=convention, label_smoothing=0.1)
        ce, _ = fused_row_losses(hidden, weight, labels, cfg, pad_id=0)
        ours = ce.sum() / (labels != IGNORE_INDEX).sum()
        assert abs(ours.item() - theirs.item()) > 2 * loss_bound


# ----------------------------------------------- every convention vs a dense target


def dense_losses(logits_NV, labels, convention, eps, pad):
    """``-sum_c q_c log p_c`` per row with ``q`` from the pure-Python reference (L6)."""
    logp = logits_NV.log_softmax(-1)
    V = logits_NV.shape[-1]
    rows = []
    for r in range(labels.shape[0]):
        if labels[r] == IGNORE_INDEX:
            rows.append(logp.new_zeros(()))
            continue
        q = ref.target_distribution(V, int(labels[r]), eps, convention, pad)
        rows.append(-(torch.tensor(q, dtype=logp.dtype) * logp[r]).sum())
    return torch.stack(rows)


@pytest.mark.parametrize("convention", ["uniform", "non_pad", "harvard"])
@pytest.mark.parametrize("eps", [0.0, 0.2, 1.0])
def test_every_path_matches_a_dense_target_in_fp64(convention, eps):
    """Every path within twice the float64 rounding bound of the dense target's
    (~1e-13 per row, ~1e-12 for sums of 50 rows); a wrong convention is off by > 1e-6."""
    hidden, weight, labels, w = make_case(dtype=torch.float64)
    pad = 3
    labels[5] = pad  # a supervised pad target (pad shares an end-of-sequence id)
    cfg = ObjectiveConfig(smoothing=convention, label_smoothing=eps, chunk_rows=7)
    want = dense_losses(hidden @ weight.T, labels, convention, eps, pad)
    want_grads = grads_of((want * w).sum(), hidden, weight)
    rows = 2 * row_bounds(hidden, weight, labels, eps, FP64_UNIT)
    gold_rows = 2 * row_bounds(hidden, weight, labels, 0.0, FP64_UNIT)
    num_bound, *grad_bounds = (2 * b for b in bounds(hidden, weight, labels, supervised(labels) * w,
                                                     eps, FP64_UNIT))
    nll_bound = 2 * bounds(hidden, weight, labels, supervised(labels), 0.0, FP64_UNIT)[0]

    ce, nll = fused_row_losses(hidden, weight, labels, cfg, pad_id=pad)
    assert within(ce, want, rows)
    for a, b, bound in zip(grads_of((ce * w).sum(), hidden, weight), want_grads, grad_bounds,
                           strict=True):
        assert within(a, b, bound)

    num, nll_sum = fused_weighted_sum(hidden, weight, labels, w, cfg, pad_id=pad)
    assert within(num, (want * w).sum(), num_bound)
    assert within(nll_sum, nll.sum(), nll_bound)
    for a, b, bound in zip(grads_of(num, hidden, weight), want_grads, grad_bounds, strict=True):
        assert within(a, b, bound)

    logits = (hidden @ weight.T).detach().requires_grad_(True)
    ce_l, _ = logits_row_losses(logits, labels, cfg, pad_id=pad)
    assert within(ce_l, want.detach(), rows)
    assert within(nll, dense_losses(hidden @ weight.T, labels, convention, 0.0, pad),
                  gold_rows)  # the gold NLL is the unsmoothed one


@pytest.mark.parametrize("convention", ["uniform", "non_pad", "harvard"])
def test_dense_target_check_catches_a_mixed_convention(convention):
    """Negative control: each convention's losses fail the check against the others' q."""
    hidden, weight, labels, _ = make_case(dtype=torch.float64)
    cfg = ObjectiveConfig(smoothing=convention, label_smoothing=0.2, chunk_rows=7)
    with torch.no_grad():
        ce, _ = fused_row_losses(hidden, weight, labels, cfg, pad_id=3)
        for other in {"uniform", "non_pad", "harvard"} - {convention}:
            want = dense_losses(hidden @ weight.T, labels, other, 0.2, 3)
            assert float((ce - want).abs().max()) > 1e-6, other


def test_gold_nll_is_unsmoothed_and_detached():
    hidden, weight, labels, _ = make_case()
    cfg = ObjectiveConfig(label_smoothing=0.3)
    ce, nll = fused_row_losses(hidden, weight, labels, cfg, pad_id=None)
    plain = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    assert within(nll, plain.detach(), 2 * row_bounds(hidden, weight, labels))
    assert not nll.requires_grad and ce.requires_grad
    assert (ce - nll).abs().max() > 1e-3  # smoothing changes the optimised value


# ------------------------------------------------------ chunked == unchunked (L1)


def all_paths(hidden, weight, labels, w, chunk_rows):
    cfg = ObjectiveConfig(label_smoothing=0.1, chunk_rows=chunk_rows)
    ce, _ = fused_row_losses(hidden, weight, labels, cfg, pad_id=None)
    num, _ = fused_weighted_sum(hidden, weight, labels, w, cfg, pad_id=None)
    logits = hidden @ weight.T
    ce_l, _ = logits_row_losses(logits, labels, cfg, pad_id=None)
    out = {}
    out["rows"] = [ce.detach(), *grads_of((ce * w).sum(), hidden, weight)]
    out["sum"] = [num.detach(), *grads_of(num, hidden, weight)]
    out["logits"] = [ce_l.detach(), *grads_of((ce_l * w).sum(), hidden, weight)]
    return out


def path_bounds(hidden, weight, labels, w) -> dict:
    """Twice the rounding bounds of ``all_paths``'s values (each path's and the other
    chunking's error): per row for ``rows`` and ``logits``, the weighted sum for ``sum``,
    the gradients of the ``w``-weighted objective for all three."""
    rows = 2 * row_bounds(hidden, weight, labels, 0.1)
    total, *grads = (2 * b for b in bounds(hidden, weight, labels, supervised(labels) * w, 0.1))
    return {"rows": [rows, *grads], "sum": [total, *grads], "logits": [rows, *grads]}


def gaps_within(a: dict, b: dict, bounds: dict) -> bool:
    return all(within(x, y, bound) for k in a
               for x, y, bound in zip(a[k], b[k], bounds[k], strict=True))


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 49, 64])
def test_chunked_losses_and_gradients_match_unchunked(chunk_rows):
    hidden, weight, labels, w = make_case(seed=1)
    whole = all_paths(hidden, weight, labels, w, chunk_rows=0)
    chunked = all_paths(hidden, weight, labels, w, chunk_rows=chunk_rows)
    assert gaps_within(whole, chunked, path_bounds(hidden, weight, labels, w))


def test_chunk_check_catches_a_dropped_remainder(monkeypatch):
    """Negative control: chunks that forget the last partial chunk fail the same check."""

    def drop_remainder(num_rows, chunk_rows):
        for start, stop in ce_module.__dict__["_real_chunk_bounds"](num_rows, chunk_rows):
            if stop - start == chunk_rows or chunk_rows <= 0:
                yield start, stop

    monkeypatch.setitem(ce_module.__dict__, "_real_chunk_bounds", ce_module.chunk_bounds)
    hidden, weight, labels, w = make_case(seed=1)
    whole = all_paths(hidden, weight, labels, w, chunk_rows=0)
    monkeypatch.setattr(ce_module, "chunk_bounds", drop_remainder)
    wrong = all_paths(hidden, weight, labels, w, chunk_rows=7)  # 50 = 7 * 7 + 1
    assert not gaps_within(whole, wrong, path_bounds(hidden, weight, labels, w))


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an aten op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("path", ["rows", "sum"])
def test_no_full_logits_or_logit_gradient_ever_exists(path):
    """L1 structurally: with chunks of 8 rows no op output reaches N * V elements."""
    n, v, h = 64, 40, 4  # N*V = 2560; chunk = 8*40 = 320; parameters: 40*4
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))

    def largest(chunk_rows: int) -> int:
        cfg = ObjectiveConfig(chunk_rows=chunk_rows, label_smoothing=0.1)
        with LargestTensor() as probe:
            if path == "rows":
                loss = fused_row_losses(hidden, weight, labels, cfg, pad_id=None)[0].sum()
            else:
                loss = fused_weighted_sum(hidden, weight, labels, torch.ones(n), cfg, pad_id=None)[
                    0
                ]
            loss.backward()
        return probe.largest

    assert largest(8) <= 8 * v
    assert largest(0) >= n * v  # negative control: unchunked does hold [N, V]


# ------------------------------------------------------------- ignored rows, index


def test_ignored_rows_have_zero_loss_and_exactly_zero_gradient():
    hidden, weight, labels, w = make_case()
    cfg = ObjectiveConfig(label_smoothing=0.2, chunk_rows=6)
    for index in (None, (labels != IGNORE_INDEX).nonzero().squeeze(1)):
        ce, nll = fused_row_losses(hidden, weight, labels, cfg, pad_id=None, rows_index=index)
        (grad_h,) = grads_of((ce * w).sum(), hidden)
        ignored = labels == IGNORE_INDEX
        assert torch.all(ce[ignored] == 0) and torch.all(nll[ignored] == 0)
        assert torch.all(grad_h[ignored] == 0)
        assert torch.all(grad_h[~ignored].abs().sum(1) > 0)


def test_row_index_path_equals_masked_path():
    """Skipping ignored rows by index gives the masked all-rows result (to 1e-5)."""
    hidden, weight, labels, w = make_case(seed=2, ignore_every=3)
    cfg = ObjectiveConfig(label_smoothing=0.1, chunk_rows=5)
    index = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    num_a, nll_a = fused_weighted_sum(hidden, weight, labels, w, cfg, pad_id=None, rows_index=index)
    # an index that covers every row means "compute all rows, mask the ignored ones"
    everything = torch.arange(N)
    num_b, nll_b = fused_weighted_sum(
        hidden, weight, labels, w, cfg, pad_id=None, rows_index=everything
    )
    # both paths round: within twice the bounds of the w-weighted sum (~1e-4 for a sum
    # of ~100), of the unweighted gold sum, and of the gradients
    num_bound, *grad_bounds = bounds(hidden, weight, labels, supervised(labels) * w, 0.1)
    assert within(num_a, num_b, 2 * num_bound)
    assert within(nll_a, nll_b, 2 * bounds(hidden, weight, labels, supervised(labels))[0])
    for a, b, bound in zip(grads_of(num_a, hidden, weight), grads_of(num_b, hidden, weight),
                           grad_bounds, strict=True):
        assert within(a, b, 2 * bound)


def test_no_supervised_row_gives_a_graph_connected_zero():
    hidden, weight, _, w = make_case()
    labels = torch.full((N,), IGNORE_INDEX)
    num, nll = fused_weighted_sum(hidden, weight, labels, w, ObjectiveConfig(), pad_id=None)
    assert num.item() == 0.0 and nll.item() == 0.0 and num.requires_grad
    grad_h, grad_w = grads_of(num, hidden, weight)
    assert torch.all(grad_h == 0) and torch.all(grad_w == 0)


def test_weighted_sum_under_no_grad_forms_no_gradient():
    hidden, weight, labels, w = make_case()
    with torch.no_grad():
        num, _ = fused_weighted_sum(hidden, weight, labels, w, ObjectiveConfig(), pad_id=None)
    assert not num.requires_grad
    num2, _ = fused_weighted_sum(hidden, weight, labels, w, ObjectiveConfig(), pad_id=None)
    assert within(num, num2.detach(), 2 * bounds(hidden, weight, labels, supervised(labels) * w)[0])


# ------------------------------------------------------------------ precision


def test_bf16_autocast_keeps_the_loss_in_fp32():
    hidden, weight, labels, w = make_case(seed=3)
    cfg = ObjectiveConfig(chunk_rows=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        num, nll = fused_weighted_sum(hidden, weight, labels, w, cfg, pad_id=None)
        ce, _ = fused_row_losses(hidden, weight, labels, cfg, pad_id=None)
    assert num.dtype == torch.float32 and ce.dtype == torch.float32
    grad_h, grad_w = grads_of(num, hidden, weight)
    assert grad_h.dtype == hidden.dtype and grad_w.dtype == weight.dtype
    exact, _ = fused_weighted_sum(hidden, weight, labels, w, cfg, pad_id=None)
    # bf16 operands (relative error <= 2**-9 each): each logit off by at most
    # (2 * 2**-9 + 2**-18) |h| @ |W|.T on top of fp32's rounding, which the bound takes
    h, W = hidden.detach().double(), weight.detach().double()
    bf16 = (2 * 2.0 ** -9 + 2.0 ** -18) * (h.abs() @ W.abs().T) + matmul_bound(h, W.T)
    q = smoothed_targets(labels, V, 0.0, IGNORE_INDEX)
    rows, _ = cross_entropy_bounds(h @ W.T, q, supervised(labels) * w, bf16)
    assert abs(num.item() - exact.item()) <= float(rows.sum()) + 2 * bounds(
        hidden, weight, labels, supervised(labels) * w)[0]
    # the bf16 matmul really happened (otherwise the results would be identical)
    assert num.item() != exact.item()


def test_bf16_logits_get_a_bf16_gradient_and_an_fp32_loss():
    logits = torch.randn(N, V).to(torch.bfloat16).requires_grad_(True)
    labels = make_case()[2]
    ce, _ = logits_row_losses(logits, labels, ObjectiveConfig(chunk_rows=8), pad_id=None)
    assert ce.dtype == torch.float32
    (grad,) = grads_of(ce.sum(), logits)
    assert grad.dtype == torch.bfloat16
    want = F.cross_entropy(logits.float(), labels, reduction="none")
    # the same fp32 logits (bf16 widens exactly) on both sides: twice the rounding bound
    rows, _ = cross_entropy_bounds(logits.detach().double(), smoothed_targets(labels, V, 0.0),
                                   torch.ones(N))
    assert within(ce, want.detach(), 2 * rows)


def test_huge_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [3e4, 3e4, 3e4]])
    ce, nll = logits_row_losses(logits, torch.tensor([1, 2]), ObjectiveConfig(), pad_id=None)
    assert torch.isfinite(ce).all()
    # exact: 2e4 and log 3; fp32 rounding of quantities of 3e4 (ulp 2**-9) dominates
    rows, _ = cross_entropy_bounds(logits.double(), smoothed_targets(torch.tensor([1, 2]), 3, 0.0),
                                   torch.ones(2))
    assert within(nll, torch.tensor([2e4, 1.0986122886681098], dtype=torch.float64), rows)


# ------------------------------------------------------------- typed errors (L2)


def test_invalid_smoothing_settings_are_typed_errors():
    with pytest.raises(ObjectiveError, match="V >= 3"):
        Smoothing.resolve("harvard", 0.1, 2, 0)
    with pytest.raises(ObjectiveError, match=r"\[0, 1\]"):
        Smoothing.resolve("uniform", 1.5, 10, None)
    with pytest.raises(ObjectiveError, match="pad id"):
        Smoothing.resolve("non_pad", 0.1, 10, None)
    with pytest.raises(ObjectiveError, match="pad id"):
        Smoothing.resolve("harvard", 0.1, 10, None)
    with pytest.raises(ObjectiveError, match="outside the vocabulary"):
        Smoothing.resolve("harvard", 0.1, 10, 10)
    with pytest.raises(ConfigError, match="label_smoothing"):
        ObjectiveConfig(label_smoothing=-0.1)
    hidden, weight, labels, _ = make_case()
    with pytest.raises(ObjectiveError, match="harvard"):
        fused_row_losses(
            hidden, weight[:2], labels.clamp(max=1), ObjectiveConfig(smoothing="harvard"), pad_id=0
        )
    with pytest.raises(ObjectiveError, match="line up"):
        fused_row_losses(hidden, weight[:, :3], labels, ObjectiveConfig(), pad_id=None)
