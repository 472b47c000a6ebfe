"""Small in-memory streams shared by the background-loading tests (P3)."""

from __future__ import annotations

import numpy as np

from exactstep.rows.config import BatchConfig
from exactstep.rows.example import Example
from exactstep.rows.stream import RowStream

CFG = BatchConfig(seq_len=16, rows=2, buffer=8)


def examples(n: int = 40, seed: int = 0) -> list[Example]:
    """``n`` random byte examples of 2 to 29 tokens."""
    rng = np.random.default_rng(seed)
    return [Example(i, rng.integers(0, 256, int(rng.integers(2, 30))).astype(np.int64))
            for i in range(n)]


def stream(exs, **kw) -> RowStream:
    """A stream over ``exs`` under ``CFG`` (byte vocabulary, seed 5)."""
    return RowStream(exs, CFG, pad_id=258, seed=5, vocab_size=259, **kw)
