"""Examples: token sequences that already own their targets (R1, R5, R8).

An ``Example`` is what every objective compiler consumes: its tokens, which of them
are supervised targets (``owned[j]`` is ``a_j`` of R5) and an optional weight (L3);
compilers turn target ownership into row ownership by the shift (R1).
``DataBundle`` holds both splits with what the manifest records about them (S1).
Design and derivations: docs/design/rows.md#rowsexamplepy (R1, R5, R8, L3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exactstep.data.documents import Document
from exactstep.data.tokenizer import ByteTokenizer
from exactstep.errors import ConfigError

# Reductions whose coefficients are the examples' weights (L3).
WEIGHTED_REDUCTIONS = ("weighted", "weighted_count")


@dataclass(frozen=True)
class Example:
    """One example.

    ``example_id``: index in its source split (the first field of a row address, R6).
    ``tokens``: int64 ``[n]``, for text ``BOS ... EOS``.
    ``owned``: bool ``[n]``; ``owned[j]`` means token ``j`` is a supervised target.
    ``None`` means every token but the first. ``owned[0]`` can never be an in-example
    target (no row of the example precedes it).
    ``weight``: the example's L3 weight (finite, >= 0) from its source, or ``None``;
    the compilers give it to every column of every piece of the example
    (``Batch.weights``).
    ``columns``: the values of the source's declared further fields (``data.columns``),
    or ``None``; a policy reward sees them.
    """

    example_id: int
    tokens: np.ndarray  # [n] int64
    owned: np.ndarray | None = None  # [n] bool
    weight: float | None = None
    columns: dict[str, Any] | None = None  # its source's declared columns (data.columns)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def targets_in(self, start: int, stop: int) -> int:
        """How many owned target tokens lie in ``[max(start, 1), stop)``."""
        start = max(start, 1)
        if stop <= start:
            return 0
        if self.owned is None:
            return stop - start
        return int(np.count_nonzero(self.owned[start:stop]))


def encode_documents(docs: Sequence[Document], tokenizer: ByteTokenizer) -> list[Example]:
    """``BOS + UTF-8 bytes + EOS`` per document; ``example_id`` = position in ``docs``;
    the document's weight (if any) carried over."""
    head = np.array([tokenizer.bos_id], dtype=np.int64)
    tail = np.array([tokenizer.eos_id], dtype=np.int64)
    return [
        Example(
            example_id=i,
            tokens=np.concatenate([head, tokenizer.encode_array(d.text), tail]),
            weight=d.weight,
            columns=d.columns,
        )
        for i, d in enumerate(docs)
    ]


def all_weighted(examples: Sequence[Example]) -> bool:
    """Every example carries a weight (then batches carry ``weights``, L3)."""
    return bool(examples) and all(e.weight is not None for e in examples)


def require_weights(examples: Sequence[Example], reduction: str, *, source: str) -> None:
    """Refuse ``objective.reduction = weighted | weighted_count`` over examples that do
    not all carry a ``weight`` (L3), before the first step.

    A missing weight is never read as 1. Raises ``ConfigError`` naming the reduction,
    the missing ``"weight"`` field, the source and the first example without one;
    any other reduction passes (weights, if present, are then unused).
    """
    if reduction not in WEIGHTED_REDUCTIONS or not examples:
        return  # no examples at all is the packer's error to report
    missing = [e.example_id for e in examples if e.weight is None]
    if not missing:
        return
    raise ConfigError(
        f"objective.reduction = '{reduction}' needs a numeric \"weight\" field on every "
        f"example, but {len(missing)} of {len(examples)} training examples of data.source "
        f"{source!r} have none (first: example {missing[0]}); built-in sources (stdlib, "
        "arith) carry no weights. "
        'Give every JSONL line (text) or conversation (chat) a "weight", or set '
        "objective.reduction to token_mean, sequence_mean or microbatch_mean"
    )


@dataclass
class DataBundle:
    """Both splits of a run's examples plus what the manifest records about them (S1):
    the ``data`` and ``representation`` sections, and for a demo with a checkable
    answer the held-out conversations scored at the end of a run."""

    train: list[Example]
    val: list[Example]
    section: dict[str, Any]
    representation: dict[str, Any]
    heldout_conversations: Any = None

    def require_weights(self, reduction: str) -> None:
        """``require_weights`` over the training split (L3); call before the first step."""
        require_weights(self.train, reduction, source=str(self.section.get("source", "?")))
