"""A plain-Python statement of BART's noising functions, their composition and BART rows
(R9, R1, R3).

Written from the BART paper's definitions (Lewis et al. 2019, section 2.2) and
fairseq's ``DenoisingDataset`` budget rule for infilling, with the differences this
project declares (docs/design/families.md#familiesbartcompilerpy), not from
``exactstep.families.bart.compiler``. Plain lists, no NumPy and no torch in the logic:
the only thing taken from outside is the stream of random draws, handed in as a
``Draws`` object (``random(n)``, ``poisson(lam, n)``, ``permutation(n)``,
``integers(n)``), so the oracle consumes the very draws the compiler's addressed
generator makes, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Protocol

IGNORE = -100
BART_STREAM = 0x42415254  # the family's tag, written out: "BART"
NEWLINE, SPACE = 10, 32
PUNCTUATION = (46, 33, 63)  # . ! ?


class Draws(Protocol):
    def random(self, n: int) -> list[float]: ...

    def poisson(self, lam: float, n: int) -> list[int]: ...

    def permutation(self, n: int) -> list[int]: ...

    def integers(self, n: int) -> int: ...


def token_masking(x: list[int], rate: float, draws: Draws, mask: int) -> list[int]:
    u = draws.random(len(x))
    return [mask if u[i] < rate else t for i, t in enumerate(x)]


def token_deletion(x: list[int], rate: float, draws: Draws) -> list[int]:
    u = draws.random(len(x))
    return [t for i, t in enumerate(x) if not u[i] < rate]


def uncapped_lengths(budget: int, lam: float, draws: Draws) -> list[int]:
    """Poisson lengths, ``budget`` at a time, until they cover ``budget``; the first one
    to reach it cut to fit, the later ones dropped; every zero-length span kept (no cap,
    fairseq-like)."""
    lengths: list[int] = []
    while sum(lengths) < budget:
        lengths += draws.poisson(lam, budget)
    total, cut = 0, []
    for length in lengths:
        if total + length >= budget:
            cut.append(budget - total)
            break
        cut.append(length)
        total += length
    return cut


def span_lengths(budget: int, lam: float, draws: Draws) -> list[int]:
    """``uncapped_lengths``, then zero-length spans beyond ``budget - positive`` dropped
    (the earliest kept)."""
    cut = uncapped_lengths(budget, lam, draws)
    room = budget - sum(1 for length in cut if length > 0)
    out = []
    for length in cut:
        if length == 0:
            if room == 0:
                continue
            room -= 1
        out.append(length)
    return out


def text_infilling(x: list[int], rate: float, lam: float, draws: Draws, mask: int) -> list[int]:
    budget = math.ceil(Fraction(str(rate)) * len(x))  # the rate as written: 0.07 * 100 = 7
    if budget == 0:
        return list(x)
    lengths = span_lengths(budget, lam, draws)
    k = len(lengths)
    slots = draws.permutation(len(x) - budget + k)[:k]
    span_in_slot = {slot: j for j, slot in enumerate(slots)}
    out, read = [], 0
    for slot in range(len(x) - budget + k):
        if slot in span_in_slot:
            out.append(mask)
            read += lengths[span_in_slot[slot]]
        else:
            out.append(x[read])
            read += 1
    assert read == len(x), "the spans and kept tokens cover the piece exactly"
    return out


def sentences(x: list[int]) -> list[list[int]]:
    """``x`` cut after each newline and after each ``.``/``!``/``?`` followed by a space."""
    out: list[list[int]] = []
    current: list[int] = []
    for i, t in enumerate(x):
        current.append(t)
        ends = t == NEWLINE or (t == SPACE and i > 0 and x[i - 1] in PUNCTUATION)
        if ends:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def sentence_permutation(x: list[int], draws: Draws) -> list[int]:
    parts = sentences(x)
    order = draws.permutation(len(parts))
    return [t for i in order for t in parts[i]]


def document_rotation(x: list[int], draws: Draws) -> list[int]:
    if not x:
        return []
    start = draws.integers(len(x))
    return x[start:] + x[:start]


def compose(x: Sequence[int], noise: Sequence[str], params: dict, draws: Draws,
            mask: int) -> list[int]:
    """``noise`` applied left to right; ``params`` holds ``token_masking_rate``,
    ``token_deletion_rate``, ``text_infilling_rate`` and ``poisson_lambda``."""
    out = list(x)
    for name in noise:
        if name == "token_masking":
            out = token_masking(out, params["token_masking_rate"], draws, mask)
        elif name == "token_deletion":
            out = token_deletion(out, params["token_deletion_rate"], draws)
        elif name == "text_infilling":
            out = text_infilling(out, params["text_infilling_rate"], params["poisson_lambda"],
                                 draws, mask)
        elif name == "sentence_permutation":
            out = sentence_permutation(out, draws)
        elif name == "document_rotation":
            out = document_rotation(out, draws)
        else:
            raise AssertionError(f"unknown noising function {name!r}")
    return out


def raw_of(tokens: Sequence[int], offset: int, length: int) -> list[int]:
    """The piece's tokens without the example's first (BOS) and last (EOS) token."""
    start, stop = max(offset, 1), min(offset + length, len(tokens) - 1)
    return list(tokens[start:stop])


def expected_sides(pieces_by_row: Sequence[Sequence[tuple[list[int], int, int]]],
                   draws: Callable[[int, int], Draws], *, seq_len: int, noise: Sequence[str],
                   params: dict, mask: int, bos: int, eos: int,
                   pad: int) -> dict[str, list[list[int]]]:
    """Every tensor of a BART batch, as nested lists. A piece is ``(example tokens,
    offset, length)``; ``draws(row, index)`` its own draw stream. Both sides
    ``seq_len`` columns; the encoder the noised piece + EOS, the decoder BOS + the
    piece in and the piece + EOS scored; positions restart per segment."""
    out = {name: [] for name in ("enc_ids", "enc_pos", "enc_seg", "dec_ids", "dec_pos",
                                 "dec_seg", "labels")}
    for b, row in enumerate(pieces_by_row):
        enc = {"ids": [], "pos": [], "seg": []}
        dec = {"ids": [], "pos": [], "seg": [], "labels": []}
        for s, (tokens, offset, length) in enumerate(row):
            raw = raw_of(tokens, offset, length)
            inputs = compose(raw, noise, params, draws(b, s), mask) + [eos]
            enc["ids"] += inputs
            enc["pos"] += list(range(len(inputs)))
            enc["seg"] += [s + 1] * len(inputs)
            dec["ids"] += [bos] + raw
            dec["labels"] += raw + [eos]
            dec["pos"] += list(range(len(raw) + 1))
            dec["seg"] += [s + 1] * (len(raw) + 1)
        assert len(enc["ids"]) <= seq_len and len(dec["ids"]) <= seq_len, "the row overflows"
        for side, name, fill in ((enc, "ids", pad), (enc, "pos", 0), (enc, "seg", 0)):
            out[f"enc_{name}"].append(side[name] + [fill] * (seq_len - len(side[name])))
        for name, fill in (("ids", pad), ("pos", 0), ("seg", 0)):
            out[f"dec_{name}"].append(dec[name] + [fill] * (seq_len - len(dec[name])))
        out["labels"].append(dec["labels"] + [IGNORE] * (seq_len - len(dec["labels"])))
    return out


class NumpyDraws:
    """The compiler's addressed generator behind the ``Draws`` interface: the only
    place NumPy enters the oracle (it hands over plain lists and ints)."""

    def __init__(self, rng) -> None:
        self.rng = rng

    def random(self, n: int) -> list[float]:
        return self.rng.random(n).tolist()

    def poisson(self, lam: float, n: int) -> list[int]:
        return self.rng.poisson(lam, size=n).tolist()

    def permutation(self, n: int) -> list[int]:
        return self.rng.permutation(n).tolist()

    def integers(self, n: int) -> int:
        return int(self.rng.integers(n))


def draws_of(seed: int, epoch: int, example_id: int, piece: int) -> NumpyDraws:
    import numpy as np

    return NumpyDraws(np.random.default_rng([seed, BART_STREAM, epoch, example_id, piece]))
