"""One microbatch's share of the window objective: ``(S_m, gold NLL sum)`` (L1-L3).

The window (U1) calls this once per microbatch with the coefficients of
``plan_window`` and backpropagates ``S_m`` (or ``S_m / D_W``); the gold NLL sum and the
token count feed the ledger and perplexity (L5). Nothing here syncs the device.
"""

from __future__ import annotations

import torch

from exactstep.objective.config import ObjectiveConfig
from exactstep.objective.cross_entropy import fused_weighted_sum, logits_row_losses
from exactstep.rows.batch import IGNORE_INDEX

Tensor = torch.Tensor


def microbatch_terms(
    hidden_BTH: Tensor,
    head_weight_VH: Tensor,
    labels_BT: Tensor,
    coeff_BT: Tensor,
    cfg: ObjectiveConfig,
    *,
    pad_id: int | None,
    rows_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(S_m = sum a_r * ce_r, sum of gold NLL over supervised rows)`` of one microbatch.

    ``hidden_BTH`` are the final hidden states (after the last norm), ``head_weight_VH``
    the output projection (tied or not); ``labels_BT`` row-aligned targets (R1);
    ``coeff_BT`` the plan's ``a_r`` (moved to the hidden states' device here).
    ``rows_index`` is the plan's ``row_indices[m]``: flat supervised rows, so ignored
    rows cost nothing. ``S_m`` is a 0-dim fp32 tensor with graph; a microbatch with no
    supervised row gives a graph-connected 0 (its backward is all zeros, D1). The NLL
    sum is detached.
    """
    H = hidden_BTH.shape[-1]
    return fused_weighted_sum(
        hidden_BTH.reshape(-1, H),
        head_weight_VH,
        labels_BT.reshape(-1),
        coeff_BT.reshape(-1),
        cfg,
        pad_id=pad_id,
        rows_index=rows_index,
    )


def logits_microbatch_terms(
    logits_BTV: Tensor,
    labels_BT: Tensor,
    coeff_BT: Tensor,
    cfg: ObjectiveConfig,
    *,
    pad_id: int | None,
    rows_index: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``microbatch_terms`` for a model that only returns logits ``[B, T, V]``."""
    V = logits_BTV.shape[-1]
    ce_N, nll_N = logits_row_losses(
        logits_BTV.reshape(-1, V), labels_BT.reshape(-1), cfg, pad_id=pad_id, rows_index=rows_index
    )
    coeff_N = coeff_BT.reshape(-1).to(ce_N.device, non_blocking=True)
    supervised_N = (labels_BT.reshape(-1) != IGNORE_INDEX).to(nll_N.dtype)
    # one kernel for both sums: equal bit for bit under token_mean without smoothing (L2)
    return torch.dot(coeff_N.to(ce_N.dtype), ce_N), torch.dot(supervised_N, nll_N)
