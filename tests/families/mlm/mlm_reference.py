"""An independent, plain-Python statement of the masked-LM rule (R8, ``families.mlm.compiler``).

Only the random numbers are NumPy's: the oracle addresses the generator itself,
from the rule as documented (``[0x6D6C6D, seed, epoch, example id, piece]``, draws
``u`` then ``v`` then ``r``), turns the draws into Python lists, and does everything
else -- eligibility, the count, the ranking, the 80/10/10 decision, the layout of
rows -- with Python's own arithmetic and lists. No torch, and nothing from
``exactstep.families.mlm.compiler``.
"""

from __future__ import annotations

import math

import numpy as np

IGNORE_INDEX = -100
STREAM = 0x6D6C6D  # "mlm" in ASCII: the documented first word of every address
BOS, EOS, PAD, MASK = 256, 257, 258, 259  # the byte tokenizer with the "mask" extra
SPECIAL = {BOS, EOS, PAD, MASK}
NORMAL = list(range(256))  # every id below 260 that is not special, ascending


def count(eligible: int, rate: float) -> int:
    """None of nothing; else the rate rounded half up, and at least one."""
    if eligible == 0:
        return 0
    return max(1, int(math.floor(rate * eligible + 0.5)))


def draws(seed: int, epoch: int, example_id: int, piece: int, m: int, k: int):
    rng = np.random.default_rng([STREAM, seed, epoch, example_id, piece])
    u = [float(x) for x in rng.random(m)]
    v = [float(x) for x in rng.random(k)]
    r = [int(x) for x in rng.integers(0, len(NORMAL), size=k)]
    return u, v, r


def corrupt(tokens: list[int], address: tuple[int, int, int, int], rate: float,
            p_mask: float, p_random: float) -> tuple[list[int], list[int], list[str]]:
    """``(inputs, labels, actions)`` of one piece; actions are "", "mask", "random", "keep"."""
    eligible = [j for j, t in enumerate(tokens) if t not in SPECIAL]
    k = count(len(eligible), rate)
    u, v, r = draws(*address, len(eligible), k)
    ranked = sorted(range(len(eligible)), key=lambda i: (u[i], i))
    chosen = sorted(eligible[i] for i in ranked[:k])
    inputs, labels, actions = list(tokens), [IGNORE_INDEX] * len(tokens), [""] * len(tokens)
    for j, col in enumerate(chosen):
        labels[col] = tokens[col]
        if v[j] < p_mask:
            inputs[col], actions[col] = MASK, "mask"
        elif v[j] < p_mask + p_random:
            inputs[col], actions[col] = NORMAL[r[j]], "random"
        else:
            actions[col] = "keep"
    return inputs, labels, actions


def expected_batch(rows, examples, *, seq_len: int, seed: int, rate: float = 0.15,
                   p_mask: float = 0.8, p_random: float = 0.1, positions: str = "reset"):
    """Every column of a masked-LM batch of ``rows`` (lists of ``Piece``), as lists."""
    out = {name: [[fill] * seq_len for _ in rows] for name, fill in
           (("input_ids", PAD), ("labels", IGNORE_INDEX), ("position_ids", 0),
            ("segment_ids", 0), ("actions", ""))}
    for b, row in enumerate(rows):
        col = 0
        for s, piece in enumerate(row, start=1):
            example = examples[piece.example]
            tokens = [int(t) for t in example.tokens[piece.offset : piece.offset + piece.length]]
            address = (seed, piece.epoch, example.example_id, piece.piece)
            inputs, labels, actions = corrupt(tokens, address, rate, p_mask, p_random)
            for k in range(piece.length):
                out["input_ids"][b][col + k] = inputs[k]
                out["labels"][b][col + k] = labels[k]
                out["actions"][b][col + k] = actions[k]
                out["segment_ids"][b][col + k] = s
                out["position_ids"][b][col + k] = k if positions == "reset" else col + k
            col += piece.length
    return out
