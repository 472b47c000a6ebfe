"""The probes' own expectations, in plain PyTorch (A1).

Nothing here calls the target's loop: the target contributes only its model's
forward (``TrainingStep.logits``). The shift, the masks, the token mean over the
window, label smoothing, clipping, SGD, the first AdamW step and the schedule are
written out here from ``ProbeSpec``'s declaration, so a probe compares the target
with an independent computation, never with itself; AdamW over several windows is
PyTorch's own ``torch.optim.AdamW`` on copies, driven by these gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from exactstep.audit.protocol import Microbatch, ProbeSpec, TrainingStep

IGNORE = -100
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard: coef = max_norm / (norm + 1e-6)


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Unique trainable parameters by identity (a tied embedding/head is one, U6)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every unique parameter, by name."""
    return {n: p.detach().clone() for n, p in named_parameters(module)}


@torch.no_grad()
def restore(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` back into the live parameters (the optimizer keeps its refs)."""
    for name, param in named_parameters(module):
        param.copy_(values[name])


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode inside (no dropout); prior modes restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def shifted(mb: Microbatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, document_ids, targets)``, each ``[B, L - 1]``.

    R1 and R3: row ``i`` consumes token ``i`` and is scored against token ``i + 1``
    when that token is owned and belongs to the same document; otherwise ``IGNORE``.
    """
    same_doc = (mb.documents[:, 1:] == mb.documents[:, :-1]) & (mb.documents[:, :-1] > 0)
    valid = mb.owned[:, 1:] & same_doc
    targets = torch.where(valid, mb.tokens[:, 1:], torch.full_like(mb.tokens[:, 1:], IGNORE))
    return mb.tokens[:, :-1], mb.positions[:, :-1], mb.documents[:, :-1], targets


def same_document(mb: Microbatch) -> torch.Tensor:
    """``[B, L - 1]``: tokens ``i`` and ``i + 1`` belong to one document."""
    return (mb.documents[:, 1:] == mb.documents[:, :-1]) & (mb.documents[:, :-1] > 0)


def masked(tokens: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, tokens, torch.full_like(tokens, IGNORE))


# Known wrong alignments, for naming what a failing update matches (a diagnosis only).
def no_shift(mb: Microbatch) -> tuple[torch.Tensor, ...]:
    return (mb.tokens, mb.positions, mb.documents,
            masked(mb.tokens, mb.owned & (mb.documents > 0)))


def reversed_shift(mb: Microbatch) -> tuple[torch.Tensor, ...]:
    return (mb.tokens[:, 1:], mb.positions[:, 1:], mb.documents[:, 1:],
            masked(mb.tokens[:, :-1], mb.owned[:, 1:] & same_document(mb)))


def double_shift(mb: Microbatch) -> tuple[torch.Tensor, ...]:
    keep = mb.owned[:, 1:] & same_document(mb)
    return (mb.tokens[:, :-2], mb.positions[:, :-2], mb.documents[:, :-2],
            masked(mb.tokens[:, 2:], keep[:, 1:] & keep[:, :-1]))


def unshifted_ownership(mb: Microbatch) -> tuple[torch.Tensor, ...]:
    return (mb.tokens[:, :-1], mb.positions[:, :-1], mb.documents[:, :-1],
            masked(mb.tokens[:, 1:], mb.owned[:, :-1] & same_document(mb)))


WRONG_ALIGNMENTS: dict[str, Callable] = {
    "no shift (each row scored against its own token)": no_shift,
    "reversed shift (each row scored against the previous token)": reversed_shift,
    "double shift (each row scored two tokens ahead)": double_shift,
    "unshifted ownership (owned[:, :-1] instead of owned[:, 1:])": unshifted_ownership,
}


def row_losses(logits_NV: torch.Tensor, gold_N: torch.Tensor, spec: ProbeSpec) -> torch.Tensor:
    """Per-row cross entropy with the declared smoothing (L2), ``[N]``.

    ``loss = lse(z) - (1 - eps) z[gold] - eps * mean(z[S])`` where ``S`` is every class
    (``uniform``), every class but pad (``non_pad``) or every class but gold and pad
    (``harvard``; every class but gold when gold is pad).
    """
    z = logits_NV.float()
    lse = torch.logsumexp(z, dim=-1)  # [N]
    nll = lse - z.gather(1, gold_N[:, None]).squeeze(1)
    eps = spec.label_smoothing
    if eps == 0.0:
        return nll
    support = torch.ones_like(z, dtype=torch.bool)  # [N, V]
    if spec.smoothing_convention in ("non_pad", "harvard"):
        support[:, spec.pad_id] = False
    if spec.smoothing_convention == "harvard":
        support.scatter_(1, gold_N[:, None], False)  # gold == pad: every class but gold
    mean_z = (z * support).sum(-1) / support.sum(-1)
    return (1.0 - eps) * nll + eps * (lse - mean_z)


Alignment = Callable[[Microbatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]]


def nll_sum(step: TrainingStep, mb: Microbatch, spec: ProbeSpec, *, smoothed: bool = True,
            align: Alignment = shifted) -> tuple[torch.Tensor, int]:
    """Graph-connected sum of the declared row losses of ``mb`` and its target count
    (``align``: the declared shift; a diagnosis passes a known wrong one)."""
    input_ids, position_ids, document_ids, targets = align(mb)
    keep = targets != IGNORE
    count = int(keep.sum())
    if count == 0:
        return torch.zeros(()), 0
    logits = step.logits(input_ids, position_ids, document_ids)  # [B, L-1, V]
    if not torch.isfinite(logits).all():
        raise ValueError("logits() returned non-finite values; the reference needs finite "
                         "logits")
    use = spec if smoothed else _unsmoothed(spec)
    return row_losses(logits[keep], targets[keep], use).sum(), count


def _unsmoothed(spec: ProbeSpec) -> ProbeSpec:
    return replace(spec, label_smoothing=0.0)


def window_gradient(step: TrainingStep, window: Sequence[Microbatch], spec: ProbeSpec,
                    align: Alignment = shifted, *, scale: float = 1.0
                    ) -> tuple[dict[str, torch.Tensor], int]:
    """The gradient of the window's token-mean loss (U1) at the current parameters,
    computed without dropout, and the window's supervised target count. ``scale``
    multiplies the loss before the backward, as a loss scaler does (U2): the gradient
    is then ``scale`` times the unscaled one, not unscaled again."""
    params = named_parameters(step.module)
    with eval_mode(step.module):
        total = torch.zeros(())
        count = 0
        for mb in window:
            s, n = nll_sum(step, mb, spec, align=align)
            total = total + s
            count += n
        if count == 0:
            return {n: torch.zeros_like(p) for n, p in params}, 0
        grads = torch.autograd.grad(total / count * scale, [p for _, p in params],
                                    allow_unused=True)
    return {
        n: torch.zeros_like(p) if g is None else g.detach()
        for (n, p), g in zip(params, grads, strict=True)
    }, count


MAX_SCALE_EXPONENT = 127  # 2**127: the largest power-of-two fp32 loss scale


def scaled_gradient_finite(step: TrainingStep, window: Sequence[Microbatch],
                           spec: ProbeSpec, exponent: int) -> bool:
    """Whether the backward of ``2**exponent`` times the window's token-mean loss,
    through the target's ``logits`` without dropout, leaves every unique parameter's
    gradient finite (U2, U4). An activation's gradient that overflows first reaches the
    parameters behind it as inf or NaN, so this is the whole backward's overflow."""
    grads, _ = window_gradient(step, window, spec, scale=2.0 ** exponent)
    return all(bool(torch.isfinite(g).all()) for g in grads.values())


def overflow_exponent(step: TrainingStep, window: Sequence[Microbatch], spec: ProbeSpec,
                      top: int = MAX_SCALE_EXPONENT) -> int | None:
    """The smallest ``k`` in ``0..top`` at which ``scaled_gradient_finite`` is False, or
    ``None`` when the scaled gradient is finite even at ``2**top``.

    A power-of-two scale is exact in floating point, so the scaled backward is exactly
    ``2**k`` times the unscaled one until some value overflows; overflow is therefore
    monotone in ``k`` and a bisection finds the threshold (``log2(top)`` backwards)."""
    if scaled_gradient_finite(step, window, spec, top):
        return None
    if not scaled_gradient_finite(step, window, spec, 0):
        return 0
    finite, overflows = 0, top  # invariant: finite at 2**finite, overflow at 2**overflows
    while overflows - finite > 1:
        mid = (finite + overflows) // 2
        if scaled_gradient_finite(step, window, spec, mid):
            finite = mid
        else:
            overflows = mid
    return overflows


def clip_global(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    """Global L2 clipping over unique parameters (U3), torch's coefficient."""
    if max_norm <= 0:
        return grads
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in
                                                 grads.values()]))
    coef = min(1.0, max_norm / (float(norm) + CLIP_EPS))
    return {n: g * coef for n, g in grads.items()}


def windows_of(microbatches: Sequence[Microbatch], accum: int) -> list[list[Microbatch]]:
    """Consecutive windows of ``accum`` microbatches; the remainder is a window (U1)."""
    return [list(microbatches[i:i + accum]) for i in range(0, len(microbatches), accum)]


def reference_sgd(step: TrainingStep, microbatches: Sequence[Microbatch], spec: ProbeSpec,
                  *, start: dict[str, torch.Tensor] | None = None,
                  align: Alignment = shifted,
                  lr_at: Callable[[int], float] | None = None) -> dict[str, torch.Tensor]:
    """The parameters a correct plain-SGD loop reaches from the current (or ``start``)
    parameters; the live parameters are left as they were. ``lr_at``: the rate of the
    update taken after ``k`` committed ones (default the declared ``spec.lr_at``; a
    diagnosis passes a known wrong schedule)."""
    lr_at = spec.lr_at if lr_at is None else lr_at
    before = snapshot(step.module)
    if start is not None:
        restore(step.module, start)
    committed = 0
    try:
        for window in windows_of(microbatches, spec.accum):
            grads, count = window_gradient(step, window, spec, align)
            if count == 0:
                continue  # L4: no objective, nothing advances
            grads = clip_global(grads, spec.clip)
            lr = lr_at(committed)
            with torch.no_grad():
                for name, param in named_parameters(step.module):
                    param.sub_(lr * grads[name])
            committed += 1
        return snapshot(step.module)
    finally:
        restore(step.module, before)


def lookup_ids(func, args) -> torch.Tensor | None:  # noqa: ANN001
    """The integer ids of a table lookup (``args[0]`` is the table): ``aten.embedding``
    (``nn.Embedding``, ``F.embedding``), integer indexing (``W[ids]``) and
    ``index_select``; ``None`` for any other op."""
    if func is torch.ops.aten.embedding.default:
        return args[1]
    if func is torch.ops.aten.index.Tensor:
        ids = [i for i in args[1] if isinstance(i, torch.Tensor)
               and not i.is_floating_point() and i.dtype != torch.bool]
        return ids[0] if ids else None
    if func is torch.ops.aten.index_select.default:
        return args[2]
    return None


class LookupRecorder(TorchDispatchMode):
    """Records the storages read as a lookup table (``lookup_ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if lookup_ids(func, args) is not None and isinstance(args[0], torch.Tensor):
            self.tables.add(args[0].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def lookup_tables(step: TrainingStep, mb: Microbatch) -> set[str]:
    """The parameters the target's forward reads as lookup tables (embeddings), found by
    behaviour, not by module type: a table held as an ``nn.Parameter`` and read with
    ``F.embedding`` or indexing is one, as an ``nn.Embedding``'s weight is (U6)."""
    recorder = LookupRecorder()
    with eval_mode(step.module), torch.no_grad(), recorder:
        step.logits(mb.tokens, mb.positions, mb.documents)
    return {n for n, p in named_parameters(step.module)
            if p.untyped_storage().data_ptr() in recorder.tables}


def decays(step: TrainingStep, mb: Microbatch) -> dict[str, bool]:
    """The declared decay group (U6): matrices that the forward does not read as a
    lookup table (``lookup_tables``); norms, biases and embeddings are not decayed."""
    tables = lookup_tables(step, mb)
    return {n: p.ndim >= 2 and n not in tables for n, p in named_parameters(step.module)}


def adamw_first_step(theta: dict[str, torch.Tensor], grads: dict[str, torch.Tensor],
                     spec: ProbeSpec, decay: dict[str, bool]) -> dict[str, torch.Tensor]:
    """The first AdamW update in closed form: with bias correction ``m_hat = g`` and
    ``sqrt(v_hat) = |g|``, so ``theta_1 = theta_0 (1 - lr wd [decayed]) - lr g / (|g| + eps)``."""
    lr = spec.lr_at(0)
    out = {}
    for name, t in theta.items():
        g = grads[name]
        shrink = 1.0 - lr * spec.weight_decay if decay[name] else 1.0
        out[name] = t * shrink - lr * g / (g.abs() + spec.eps)
    return out


# Known wrong AdamW loops, for naming what a failing multi-step update matches.
ADAMW_VARIANTS = {
    "swapped_betas": "AdamW with the betas swapped ((beta2, beta1))",
    "amsgrad": "AdamW with amsgrad=True (the running maximum of v)",
    "fresh": "a new optimizer every window (moments and step count reset)",
    "no_bias_correction": "Adam without bias correction (m / (sqrt(v) + eps))",
}


def reference_adamw(step: TrainingStep, microbatches: Sequence[Microbatch], spec: ProbeSpec,
                    decay: dict[str, bool], *, variant: str | None = None
                    ) -> list[dict[str, torch.Tensor]]:
    """The parameters after each committed window of a correct AdamW loop (U1, U5, U6)
    from the current parameters: ``torch.optim.AdamW`` (one instance for the run, the
    declared ``betas``, ``eps``, ``weight_decay`` on the ``decay`` group, rate
    ``spec.lr_at(k)``) stepping detached copies with each window's reference gradient,
    taken at the reference's own parameters. ``variant`` (a key of ``ADAMW_VARIANTS``)
    computes a known wrong loop instead, for a diagnosis. The live parameters are left
    as they were."""
    before = snapshot(step.module)
    shadow = {n: nn.Parameter(t.clone()) for n, t in before.items()}
    groups = [{"params": [p for n, p in shadow.items() if decay[n] == flag],
               "weight_decay": spec.weight_decay if flag else 0.0} for flag in (True, False)]
    groups = [g for g in groups if g["params"]]

    def new_optimizer() -> torch.optim.Optimizer:
        betas = spec.betas[::-1] if variant == "swapped_betas" else spec.betas
        if variant == "no_bias_correction":
            return AdamWithoutBiasCorrection(groups, lr=spec.lr, betas=betas, eps=spec.eps)
        return torch.optim.AdamW(groups, lr=spec.lr, betas=betas, eps=spec.eps,
                                 amsgrad=variant == "amsgrad", foreach=False)

    optimizer = new_optimizer()
    states: list[dict[str, torch.Tensor]] = []
    try:
        for window in windows_of(microbatches, spec.accum):
            grads, count = window_gradient(step, window, spec)
            if count == 0:
                continue  # L4: no objective, nothing advances
            grads = clip_global(grads, spec.clip)
            if variant == "fresh":
                optimizer = new_optimizer()
            for name, param in shadow.items():
                param.grad = grads[name].clone()
            for group in optimizer.param_groups:
                group["lr"] = spec.lr_at(len(states))
            optimizer.step()
            restore(step.module, {n: p.detach() for n, p in shadow.items()})
            states.append(snapshot(step.module))
        return states
    finally:
        restore(step.module, before)


class AdamWithoutBiasCorrection(torch.optim.Optimizer):
    """AdamW's decoupled decay with ``m / (sqrt(v) + eps)`` (no ``1 - beta**t``)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float],
                 eps: float) -> None:
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001
        for group in self.param_groups:
            (b1, b2), lr = group["betas"], group["lr"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - lr * group["weight_decay"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-lr)


def eval_reference(step: TrainingStep, microbatches: Sequence[Microbatch],
                   spec: ProbeSpec) -> tuple[float, int]:
    """Gold NLL sum and target count over ``microbatches`` in eval mode (E1, L5)."""
    total, count = 0.0, 0
    with eval_mode(step.module), torch.no_grad():
        for mb in microbatches:
            s, n = nll_sum(step, mb, spec, smoothed=False)
            total += float(s)
            count += n
    return total, count


def window_loss(step: TrainingStep, window: Sequence[Microbatch], spec: ProbeSpec, *,
                align: Alignment = shifted) -> tuple[float, list[tuple[float, int]]]:
    """The declared loss of ``window`` at the current parameters, without dropout: the
    token mean of the declared (smoothed) row losses over every supervised target of its
    microbatches (U1, L2, L3), and each microbatch's ``(sum, count)`` for a diagnosis."""
    parts = []
    with eval_mode(step.module), torch.no_grad():
        for mb in window:
            s, n = nll_sum(step, mb, spec, align=align)
            parts.append((float(s), n))
    count = sum(n for _, n in parts)
    return (sum(s for s, _ in parts) / count if count else float("nan")), parts
