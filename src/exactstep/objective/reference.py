"""A pure-Python oracle for the masked next-token loss (L6). No torch, no numpy.

Written from the definitions, independently of the torch path, for small inputs: the
shift (R1), the per-row cross entropy and its gradient under the three smoothing
conventions (L2), and the token mean beside the mean of row means (L3). The tests
compare the torch path with it.
Design and derivations: docs/design/objective.md#objectivereferencepy (L6, R1, L2, L3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

IGNORE_INDEX = -100  # equal to exactstep.rows.batch.IGNORE_INDEX (a test pins it)


def log_sum_exp(values: Sequence[float]) -> float:
    """``log(sum(exp(v)))`` computed after subtracting the maximum (no overflow)."""
    top = max(values)
    return top + math.log(math.fsum(math.exp(v - top) for v in values))


def log_softmax(logits: Sequence[float]) -> list[float]:
    lse = log_sum_exp(logits)
    return [z - lse for z in logits]


def target_distribution(
    vocab_size: int,
    gold: int,
    eps: float = 0.0,
    convention: str = "uniform",
    pad_id: int | None = None,
) -> list[float]:
    """The smoothed target ``q`` of one row (L2), spelled out class by class.

    ``uniform``: ``1 - eps + eps/V`` on gold, ``eps/V`` elsewhere. ``non_pad``: eps spread
    over the ``V - 1`` classes other than pad. ``harvard``: gold ``1 - eps``, pad 0,
    ``eps/(V-2)`` on every other class (if gold is pad: ``eps/(V-1)`` on the others).
    """
    if convention == "uniform":
        support = list(range(vocab_size))
    elif convention == "non_pad":
        support = [c for c in range(vocab_size) if c != pad_id]
    elif convention == "harvard":
        support = [c for c in range(vocab_size) if c != pad_id and c != gold]
    else:
        raise ValueError(f"unknown smoothing convention {convention!r}")
    q = [0.0] * vocab_size
    for c in support:
        q[c] += eps / len(support)
    q[gold] += 1.0 - eps
    return q


def row_loss(
    logits: Sequence[float],
    gold: int,
    eps: float = 0.0,
    convention: str = "uniform",
    pad_id: int | None = None,
) -> tuple[float, float]:
    """(smoothed cross entropy, gold NLL) of one row."""
    logp = log_softmax(logits)
    q = target_distribution(len(logits), gold, eps, convention, pad_id)
    smoothed = -math.fsum(qc * lp for qc, lp in zip(q, logp, strict=True) if qc != 0.0)
    return smoothed, -logp[gold]


def row_logit_gradient(
    logits: Sequence[float],
    gold: int,
    eps: float = 0.0,
    convention: str = "uniform",
    pad_id: int | None = None,
) -> list[float]:
    """``d(smoothed CE)/d(logits) = softmax(z) - q`` for one row."""
    q = target_distribution(len(logits), gold, eps, convention, pad_id)
    return [math.exp(lp) - qc for lp, qc in zip(log_softmax(logits), q, strict=True)]


def next_token_labels(tokens: Sequence[int], is_target: Sequence[bool] | None = None) -> list[int]:
    """Row-aligned labels from one sequence (R1): ``labels[i] = tokens[i+1]`` if owned.

    ``is_target[j]`` says whether token ``j`` is supervised (``a_j``; default: all but
    the first); row ``i`` owns the loss of token ``i+1``. The last row has no target.
    """
    owned = list(is_target) if is_target is not None else [j > 0 for j in range(len(tokens))]
    labels = []
    for i in range(len(tokens)):
        nxt = i + 1
        labels.append(tokens[nxt] if nxt < len(tokens) and owned[nxt] else IGNORE_INDEX)
    return labels


def row_losses(
    logits: Sequence[Sequence[Sequence[float]]],
    labels: Sequence[Sequence[int]],
    eps: float = 0.0,
    convention: str = "uniform",
    pad_id: int | None = None,
) -> list[list[tuple[float, float]]]:
    """Per sequence, the (smoothed, gold NLL) of every supervised row, in order."""
    out = []
    for seq_logits, seq_labels in zip(logits, labels, strict=True):
        out.append(
            [
                row_loss(z, y, eps, convention, pad_id)
                for z, y in zip(seq_logits, seq_labels, strict=True)
                if y != IGNORE_INDEX
            ]
        )
    return out


def token_mean(values: Sequence[Sequence[float]]) -> float:
    """Every supervised row weighs the same: ``sum / count`` over all sequences."""
    flat = [v for seq in values for v in seq]
    return math.fsum(flat) / len(flat)


def mean_of_row_means(values: Sequence[Sequence[float]]) -> float:
    """Average each sequence, then the sequences (a different objective, L3)."""
    means = [math.fsum(seq) / len(seq) for seq in values if seq]
    return math.fsum(means) / len(means)


def masked_next_token_loss(
    logits: Sequence[Sequence[Sequence[float]]],
    labels: Sequence[Sequence[int]],
    eps: float = 0.0,
    convention: str = "uniform",
    pad_id: int | None = None,
) -> tuple[float, float, int]:
    """(token-mean smoothed CE, gold NLL sum, supervised rows) of row-aligned labels.

    ``logits[b][i]`` are row ``i``'s scores and ``labels[b][i]`` its target (already
    shifted, ``IGNORE_INDEX`` = no loss). Raises ``ValueError`` with no target at all.
    """
    per_row = row_losses(logits, labels, eps, convention, pad_id)
    count = sum(len(seq) for seq in per_row)
    if count == 0:
        raise ValueError("no supervised row: the token mean does not exist")
    smoothed = token_mean([[s for s, _ in seq] for seq in per_row])
    gold_sum = math.fsum(g for seq in per_row for _, g in seq)
    return smoothed, gold_sum, count
