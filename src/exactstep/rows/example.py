"""Examples: token sequences that already own their targets (R1, R5, R8).

An ``Example`` is what every objective compiler consumes. It says which tokens are
supervised *targets* (``owned[j]`` is ``a_j`` of R5); a compiler turns target ownership
into row ownership by the shift (``l_i = a_(i+1)``, R1). Text examples own every token
but the first; a chat template decides ownership per token (R5); other families (R8)
build their own examples and compilers on the same type.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exactstep.data.corpus import Document
from exactstep.data.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class Example:
    """One example.

    ``example_id``: index in its source split (the first field of a row address, R6).
    ``tokens``: int64 ``[n]``, for text ``BOS ... EOS``.
    ``owned``: bool ``[n]``; ``owned[j]`` means token ``j`` is a supervised target.
    ``None`` means every token but the first. ``owned[0]`` can never be an in-example
    target (no row of the example precedes it).
    """

    example_id: int
    tokens: np.ndarray  # [n] int64
    owned: np.ndarray | None = None  # [n] bool

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
    """``BOS + UTF-8 bytes + EOS`` per document; ``example_id`` = position in ``docs``."""
    head = np.array([tokenizer.bos_id], dtype=np.int64)
    tail = np.array([tokenizer.eos_id], dtype=np.int64)
    return [
        Example(example_id=i, tokens=np.concatenate([head, tokenizer.encode_array(d.text), tail]))
        for i, d in enumerate(docs)
    ]


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
