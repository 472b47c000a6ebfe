"""Row losses: fp32 cross entropy, chunked over rows, with the head fused in (L1, L2).

Sits between the model's hidden states and the window objective: ``fused_row_losses``
and ``fused_weighted_sum`` project onto the head one chunk of rows at a time, so the
full ``[N, V]`` fp32 logits never exist, and ``logits_row_losses`` serves models that
return logits. The log-sum-exp is fp32, ignored rows give exactly 0, and nothing here
syncs the device (U7).
Design and derivations: docs/design/objective.md#objectivecross_entropypy (L1, L2, U7).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from exactstep.errors import ObjectiveError
from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.smoothing import Smoothing
from exactstep.rows.batch import IGNORE_INDEX
from exactstep.rows.transfer import host_to_device

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- helpers


#: The most bytes one chunk's fp32 logits may take (L1): ``chunk_rows`` is lowered to
#: ``CHUNK_LOGIT_BYTES // (4 V)`` rows when it asks for more, so a chunk stays this small
#: at any vocabulary (1024 rows at V = 151,936 are 594 MiB). Measurements and why 64:
#: docs/design/objective.md#chunk-size-in-bytes-l1.
CHUNK_LOGIT_BYTES = 64 * 2**20


def rows_per_chunk(chunk_rows: int, vocab_size: int) -> int:
    """The rows a chunk holds: ``chunk_rows`` capped by ``CHUNK_LOGIT_BYTES`` (at least
    one row); ``0`` (unchunked, asked for explicitly) stays ``0``."""
    if chunk_rows <= 0:
        return 0
    return max(1, min(chunk_rows, CHUNK_LOGIT_BYTES // (4 * max(vocab_size, 1))))


def chunk_bounds(num_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` of each chunk; ``chunk_rows = 0`` means one chunk of all rows."""
    step = num_rows if chunk_rows <= 0 else chunk_rows
    for start in range(0, num_rows, max(step, 1)):
        yield start, min(start + step, num_rows)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The head matmul's dtype: autocast's when it is on, else the inputs' promotion."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def resolve_smoothing(cfg: ObjectiveConfig, vocab_size: int, pad_id: int | None) -> Smoothing:
    return Smoothing.resolve(cfg.smoothing, cfg.label_smoothing, vocab_size, pad_id)


def supervised_index(labels_N: Tensor, rows_index: Tensor | None) -> Tensor | None:
    """Flat indices of supervised rows, or ``None`` to compute over every row.

    A caller-provided ``rows_index`` (computed on the host before the batch moved) is
    used as is. CPU labels are indexed here (no device sync exists on the CPU). On an
    accelerator without an index every row is computed and ignored rows are masked.
    """
    if rows_index is not None:
        if rows_index.numel() == labels_N.numel():  # shape metadata: no sync
            return None
        return host_to_device(rows_index, labels_N.device)  # pinned, async (U7)
    if labels_N.device.type != "cpu":
        return None
    index = (labels_N != IGNORE_INDEX).nonzero().squeeze(1)
    return None if index.numel() == labels_N.numel() else index


def check_shapes(hidden_NH: Tensor, weight_VH: Tensor, labels_N: Tensor) -> None:
    if hidden_NH.dim() != 2 or weight_VH.dim() != 2 or labels_N.dim() != 1:
        raise ObjectiveError(
            "row losses take hidden [N, H], head weight [V, H] and labels [N]; got "
            f"{tuple(hidden_NH.shape)}, {tuple(weight_VH.shape)}, {tuple(labels_N.shape)}"
        )
    if hidden_NH.shape[1] != weight_VH.shape[1] or hidden_NH.shape[0] != labels_N.shape[0]:
        raise ObjectiveError(
            f"hidden {tuple(hidden_NH.shape)}, head weight {tuple(weight_VH.shape)} and "
            f"labels {tuple(labels_N.shape)} do not line up (need [N, H], [V, H], [N])"
        )


# ------------------------------------------------------------------------ chunk kernel


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every floating input dtype, except that fp64 stays fp64 (for tests)."""
    return torch.promote_types(dtype, torch.float32)


def split_labels(labels_n: Tensor) -> tuple[Tensor, Tensor]:
    """(gold class with a placeholder 0 on ignored rows, supervised mask)."""
    valid_n = labels_n != IGNORE_INDEX
    gold_n = torch.where(valid_n, labels_n, torch.zeros_like(labels_n))
    return gold_n, valid_n


def chunk_losses(
    z_nV: Tensor, gold_n: Tensor, valid_n: Tensor, sm: Smoothing
) -> tuple[Tensor, Tensor, Tensor]:
    """(smoothed CE, gold NLL, log-probabilities ``[n, V]``) of logits ``z_nV``.

    Losses are 0 on ignored rows. ``log_softmax`` is PyTorch's fused, max-subtracted
    (stable) kernel; the caller may drop ``z_nV`` right after, and reuse the returned
    log-probabilities in place for the gradient.
    """
    logp_nV = torch.log_softmax(z_nV, dim=1)
    logp_gold_n = logp_nV.gather(1, gold_n.unsqueeze(1)).squeeze(1)  # [n]
    nll_n = -logp_gold_n
    ce_n = nll_n
    if sm.active:
        support_mean_n = sm.support_sum(logp_nV, gold_n, logp_gold_n) / sm.support_size(
            gold_n, logp_nV.dtype
        )
        ce_n = (1.0 - sm.eps) * nll_n - sm.eps * support_mean_n
    zero = torch.zeros((), dtype=ce_n.dtype, device=ce_n.device)
    return torch.where(valid_n, ce_n, zero), torch.where(valid_n, nll_n, zero), logp_nV


def logit_grad_from_logp_(
    logp_nV: Tensor, gold_n: Tensor, scale_n: Tensor, sm: Smoothing
) -> Tensor:
    """In place: log-probabilities become ``scale * (softmax(z) - q)``, the logits' gradient."""
    logp_nV.exp_().mul_(scale_n.unsqueeze(1))
    sm.subtract_target(logp_nV, gold_n, scale_n)
    return logp_nV


def row_log_sum_exp(z_nV: Tensor, logp_nV: Tensor, gold_n: Tensor) -> Tensor:
    """``lse = z[gold] - logp[gold]``: the log-sum-exp without another pass over ``[n, V]``."""
    index = gold_n.unsqueeze(1)
    return (z_nV.gather(1, index) - logp_nV.gather(1, index)).squeeze(1)


def logit_grad_from_logits_(
    z_nV: Tensor, lse_n: Tensor, gold_n: Tensor, scale_n: Tensor, sm: Smoothing
) -> Tensor:
    """In place: recomputed logits become ``scale * (softmax(z) - q)``."""
    z_nV.sub_(lse_n.unsqueeze(1)).exp_()  # softmax, [n, V]
    z_nV.mul_(scale_n.unsqueeze(1))
    sm.subtract_target(z_nV, gold_n, scale_n)
    return z_nV


class RowSelection:
    """The rows a kernel runs over: all ``N`` rows, or the ``index`` subset (host-built).

    ``hidden(start, stop)`` gathers that chunk's hidden rows; ``write`` puts a chunk of
    per-row gradients back at the rows they came from.
    """

    def __init__(self, num_rows: int, index: Tensor | None) -> None:
        self.index = index
        self.count = num_rows if index is None else index.numel()

    def take(self, full: Tensor) -> Tensor:
        """The selected rows of a per-row tensor (labels, coefficients), whole."""
        return full if self.index is None else full.index_select(0, self.index)

    def hidden(self, hidden_NH: Tensor, start: int, stop: int) -> Tensor:
        if self.index is None:
            return hidden_NH[start:stop]
        return hidden_NH.index_select(0, self.index[start:stop])

    def new_grad(self, hidden_NH: Tensor) -> Tensor:
        if self.index is None or self.count == hidden_NH.shape[0]:
            return torch.empty_like(hidden_NH)
        return torch.zeros_like(hidden_NH)  # unselected rows get exactly 0

    def write(self, grad_NH: Tensor, start: int, stop: int, rows_nH: Tensor) -> None:
        if self.index is None:
            grad_NH[start:stop] = rows_nH
        else:
            grad_NH.index_copy_(0, self.index[start:stop], rows_nH)


def mm_operand(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` rounded to the compute ``dtype``, as a head matmul takes it.

    On CUDA it stays in ``dtype`` (``head_mm`` asks the kernel for an fp32 result).
    Elsewhere a bf16/fp16 operand is held in ``loss_dtype(dtype)``: the values are the
    rounded ones, and an fp32 matmul of them forms the same exact products and an
    fp32 sum (the CPU has no ``out_dtype`` matmul kernel).
    """
    rounded = t.to(dtype)
    if rounded.device.type == "cuda":
        return rounded
    return rounded.to(loss_dtype(dtype))


def head_mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of two ``mm_operand``s, in ``loss_dtype``: never rounded to bf16/fp16.

    A low-precision pair (only on CUDA, see ``mm_operand``) runs as ``torch.mm(a, b,
    out_dtype=torch.float32)``: bf16/fp16 inputs, fp32 accumulation and fp32 result.
    """
    acc = loss_dtype(a.dtype)
    if a.dtype == acc:
        return torch.mm(a, b)
    return torch.mm(a, b, out_dtype=acc)


def head_logits(h_nH: Tensor, weight_op_VH: Tensor, dtype: torch.dtype) -> Tensor:
    """Logits ``[n, V]`` of one chunk in ``loss_dtype``; operands rounded to ``dtype``
    (``weight_op_VH`` is ``mm_operand(weight, dtype)``), result never rounded (L1)."""
    return head_mm(mm_operand(h_nH, dtype), weight_op_VH.t())


def accumulate_head_grads(
    dz_nV: Tensor,
    h_nH: Tensor,
    weight_op_VH: Tensor,
    grad_h: Tensor | None,
    grad_w_acc_VH: Tensor | None,
    rows: RowSelection,
    start: int,
    stop: int,
    dtype: torch.dtype,
) -> None:
    """``grad_h[rows] = dz @ W`` and ``grad_w += dz^T @ h``: operands rounded to
    ``dtype``, products accumulated and returned in fp32+ (``head_mm``)."""
    dz_op = mm_operand(dz_nV, dtype)
    if grad_h is not None:
        rows.write(grad_h, start, stop, head_mm(dz_op, weight_op_VH).to(grad_h.dtype))
    if grad_w_acc_VH is not None:
        h_op = mm_operand(h_nH, dtype)
        if dz_op.dtype == grad_w_acc_VH.dtype:
            grad_w_acc_VH.addmm_(dz_op.t(), h_op)
        else:
            grad_w_acc_VH.add_(head_mm(dz_op.t(), h_op).to(grad_w_acc_VH.dtype))


class _FusedRowLosses(torch.autograd.Function):
    """Per-row losses with the head fused; backward recomputes each chunk (L1)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, labels_N, index, sm, chunk_rows, dtype):  # type: ignore[override]
        rows = RowSelection(hidden_NH.shape[0], index)
        acc = loss_dtype(dtype)
        with torch.autocast(hidden_NH.device.type, enabled=False):
            weight_cd = mm_operand(weight_VH, dtype)
            labels_M = rows.take(labels_N)
            ce_M = hidden_NH.new_zeros(rows.count, dtype=acc)
            nll_M = torch.zeros_like(ce_M)
            lse_M = torch.zeros_like(ce_M)
            for start, stop in chunk_bounds(rows.count, chunk_rows):
                gold_n, valid_n = split_labels(labels_M[start:stop])
                z_nV = head_logits(rows.hidden(hidden_NH, start, stop), weight_cd, dtype)
                ce, nll, logp_nV = chunk_losses(z_nV, gold_n, valid_n, sm)
                lse = row_log_sum_exp(z_nV, logp_nV, gold_n)
                del z_nV, logp_nV
                ce_M[start:stop], nll_M[start:stop], lse_M[start:stop] = ce, nll, lse
        ctx.save_for_backward(hidden_NH, weight_VH, labels_M, lse_M, index)
        ctx.sm, ctx.chunk_rows, ctx.dtype = sm, chunk_rows, dtype
        ctx.mark_non_differentiable(nll_M)
        return ce_M, nll_M

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ce_M, _grad_nll_M):  # type: ignore[override]
        hidden_NH, weight_VH, labels_M, lse_M, index = ctx.saved_tensors
        rows = RowSelection(hidden_NH.shape[0], index)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype, acc = ctx.dtype, loss_dtype(ctx.dtype)
        with torch.autocast(hidden_NH.device.type, enabled=False):
            weight_cd = mm_operand(weight_VH, dtype)
            grad_h = rows.new_grad(hidden_NH) if need_h else None
            grad_w = (
                torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device) if need_w else None
            )
            for start, stop in chunk_bounds(rows.count, ctx.chunk_rows):
                gold_n, valid_n = split_labels(labels_M[start:stop])
                scale_n = torch.where(valid_n, grad_ce_M[start:stop].to(acc), 0.0)
                h_nH = rows.hidden(hidden_NH, start, stop)
                z_nV = head_logits(h_nH, weight_cd, dtype)
                dz = logit_grad_from_logits_(z_nV, lse_M[start:stop], gold_n, scale_n, ctx.sm)
                accumulate_head_grads(dz, h_nH, weight_cd, grad_h, grad_w, rows, start, stop, dtype)
        grad_w = None if grad_w is None else grad_w.to(weight_VH.dtype)
        return grad_h, grad_w, None, None, None, None, None


class _FusedWeightedSum(torch.autograd.Function):
    """``sum coeff * ce`` with gradients formed during the forward, chunk by chunk."""

    @staticmethod
    def forward(
        ctx, hidden_NH, weight_VH, labels_N, coeff_N, index, sm, chunk_rows, dtype, need_h, need_w
    ):  # type: ignore[override]
        device = hidden_NH.device
        rows = RowSelection(hidden_NH.shape[0], index)
        acc = loss_dtype(dtype)
        with torch.autocast(device.type, enabled=False):
            weight_cd = mm_operand(weight_VH, dtype)
            labels_M, coeff_M = rows.take(labels_N), rows.take(coeff_N).to(acc)
            numerator = torch.zeros((), dtype=acc, device=device)
            nll_sum = torch.zeros((), dtype=acc, device=device)
            grad_h = rows.new_grad(hidden_NH) if need_h else None
            grad_w = torch.zeros(weight_VH.shape, dtype=acc, device=device) if need_w else None
            for start, stop in chunk_bounds(rows.count, chunk_rows):
                gold_n, valid_n = split_labels(labels_M[start:stop])
                coeff_n = torch.where(valid_n, coeff_M[start:stop], 0.0)
                h_nH = rows.hidden(hidden_NH, start, stop)
                z_nV = head_logits(h_nH, weight_cd, dtype)
                ce_n, nll_n, logp_nV = chunk_losses(z_nV, gold_n, valid_n, sm)
                del z_nV
                numerator += torch.dot(coeff_n, ce_n)
                # the same kernel as the numerator: under token_mean without smoothing
                # (coeff = supervised mask, ce = nll) both sums agree bit for bit (L2)
                nll_sum += torch.dot(valid_n.to(acc), nll_n)
                if need_h or need_w:
                    dz = logit_grad_from_logp_(logp_nV, gold_n, coeff_n, sm)
                    accumulate_head_grads(
                        dz, h_nH, weight_cd, grad_h, grad_w, rows, start, stop, dtype
                    )
        grad_w = None if grad_w is None else grad_w.to(weight_VH.dtype)
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.mark_non_differentiable(nll_sum)
        return numerator, nll_sum

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_numerator, _grad_nll):  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        grad_h = next(saved) * grad_numerator if ctx.has[0] else None  # keeps its dtype
        grad_w = next(saved) * grad_numerator if ctx.has[1] else None
        return grad_h, grad_w, None, None, None, None, None, None, None, None


class _LogitsRowLosses(torch.autograd.Function):
    """Per-row losses from given logits, chunked; backward recomputes softmax per chunk."""

    @staticmethod
    def forward(ctx, logits_NV, labels_N, sm, chunk_rows):  # type: ignore[override]
        N = logits_NV.shape[0]
        acc = loss_dtype(logits_NV.dtype)
        ce_N = logits_NV.new_zeros(N, dtype=acc)
        nll_N = torch.zeros_like(ce_N)
        lse_N = torch.zeros_like(ce_N)
        for start, stop in chunk_bounds(N, chunk_rows):
            gold_n, valid_n = split_labels(labels_N[start:stop])
            z_nV = logits_NV[start:stop].to(acc)
            ce, nll, logp_nV = chunk_losses(z_nV, gold_n, valid_n, sm)
            lse = row_log_sum_exp(z_nV, logp_nV, gold_n)
            del z_nV, logp_nV
            ce_N[start:stop], nll_N[start:stop], lse_N[start:stop] = ce, nll, lse
        ctx.save_for_backward(logits_NV, labels_N, lse_N)
        ctx.sm, ctx.chunk_rows = sm, chunk_rows
        ctx.mark_non_differentiable(nll_N)
        return ce_N, nll_N

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ce_N, _grad_nll_N):  # type: ignore[override]
        logits_NV, labels_N, lse_N = ctx.saved_tensors
        grad_logits = torch.empty_like(logits_NV)
        for start, stop in chunk_bounds(logits_NV.shape[0], ctx.chunk_rows):
            gold_n, valid_n = split_labels(labels_N[start:stop])
            scale_n = torch.where(valid_n, grad_ce_N[start:stop].to(lse_N.dtype), 0.0)
            z_nV = logits_NV[start:stop].to(lse_N.dtype, copy=True)
            grad_logits[start:stop] = logit_grad_from_logits_(
                z_nV, lse_N[start:stop], gold_n, scale_n, ctx.sm
            )
        return grad_logits, None, None, None


# ------------------------------------------------------------------------- public API


def fused_row_losses(
    hidden_NH: Tensor,
    head_weight_VH: Tensor,
    labels_N: Tensor,
    cfg: ObjectiveConfig,
    *,
    pad_id: int | None,
    rows_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row (smoothed CE [N] fp32 with graph, gold NLL [N] fp32 detached) (L1, L2).

    ``labels_N`` are row-aligned targets (R1: already shifted); ignored rows give 0.
    The full ``[N, V]`` fp32 logits and their gradient never exist at once: the head
    projection and the backward both run ``cfg.chunk_rows`` rows at a time.
    ``rows_index`` (optional, host-computed flat indices of supervised rows) lets
    ignored rows be skipped without a device sync. Gradients reach ``hidden_NH`` and
    ``head_weight_VH``; ignored rows get exactly 0 gradient. Raises ``ObjectiveError``
    for shapes that do not line up or invalid smoothing settings; a label outside
    ``[0, V)`` other than the ignore id (an R7 violation, the collator's to catch)
    fails inside ``gather``.
    """
    check_shapes(hidden_NH, head_weight_VH, labels_N)
    sm = resolve_smoothing(cfg, head_weight_VH.shape[0], pad_id)
    dtype = compute_dtype(hidden_NH, head_weight_VH)
    index = supervised_index(labels_N, rows_index)
    chunk = rows_per_chunk(cfg.chunk_rows, head_weight_VH.shape[0])
    ce_M, nll_M = _FusedRowLosses.apply(
        hidden_NH, head_weight_VH, labels_N, index, sm, chunk, dtype
    )
    return scatter_rows(ce_M, nll_M, index, labels_N.shape[0])


def scatter_rows(
    ce_M: Tensor, nll_M: Tensor, index: Tensor | None, N: int
) -> tuple[Tensor, Tensor]:
    """Per-selected-row values back to ``[N]`` (0 on unselected rows)."""
    if index is None:
        return ce_M, nll_M
    zeros_N = ce_M.new_zeros(N)
    return zeros_N.index_copy(0, index, ce_M), zeros_N.index_copy(0, index, nll_M)


def fused_weighted_sum(
    hidden_NH: Tensor,
    head_weight_VH: Tensor,
    labels_N: Tensor,
    coeff_N: Tensor,
    cfg: ObjectiveConfig,
    *,
    pad_id: int | None,
    rows_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(``sum_r coeff_r * ce_r`` 0-dim fp32 with graph, gold NLL sum 0-dim detached).

    The L3 numerator of one microbatch. Same value as
    ``(coeff * fused_row_losses(...)[0]).sum()`` (to rounding), but the gradient is
    computed chunk by chunk in the forward and stored (``[N, H]`` and ``[V, H]``), so
    the backward does no recomputation. Under ``torch.no_grad`` no gradient is formed.
    """
    check_shapes(hidden_NH, head_weight_VH, labels_N)
    if coeff_N.shape != labels_N.shape:
        raise ObjectiveError(
            f"coefficients {tuple(coeff_N.shape)} must match labels {tuple(labels_N.shape)}"
        )
    sm = resolve_smoothing(cfg, head_weight_VH.shape[0], pad_id)
    dtype = compute_dtype(hidden_NH, head_weight_VH)
    coeff_N = host_to_device(coeff_N, hidden_NH.device)  # pinned, async (U7)
    index = supervised_index(labels_N, rows_index)
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden_NH.requires_grad
    need_w = grad_on and head_weight_VH.requires_grad
    return _FusedWeightedSum.apply(
        hidden_NH,
        head_weight_VH,
        labels_N,
        coeff_N,
        index,
        sm,
        rows_per_chunk(cfg.chunk_rows, head_weight_VH.shape[0]),
        dtype,
        need_h,
        need_w,
    )


def logits_row_losses(
    logits_NV: Tensor,
    labels_N: Tensor,
    cfg: ObjectiveConfig,
    *,
    pad_id: int | None,
    rows_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-row (smoothed CE, gold NLL) from logits a model already produced (L1, L2).

    Chunked over rows with an fp32 log-sum-exp; the gradient is written in the logits'
    own dtype, so bf16 logits never get a full fp32 copy or fp32 gradient.
    """
    if logits_NV.dim() != 2 or labels_N.dim() != 1 or logits_NV.shape[0] != labels_N.shape[0]:
        raise ObjectiveError(
            f"logits [N, V] and labels [N] do not line up: {tuple(logits_NV.shape)}, "
            f"{tuple(labels_N.shape)}"
        )
    sm = resolve_smoothing(cfg, logits_NV.shape[1], pad_id)
    index = supervised_index(labels_N, rows_index)
    chunk = rows_per_chunk(cfg.chunk_rows, logits_NV.shape[1])
    if index is None:
        return _LogitsRowLosses.apply(logits_NV, labels_N, sm, chunk)
    ce_M, nll_M = _LogitsRowLosses.apply(
        logits_NV.index_select(0, index), labels_N.index_select(0, index), sm, chunk
    )
    return scatter_rows(ce_M, nll_M, index, labels_N.shape[0])
