"""A plain-Python statement of MASS rows (R9; R1, R3, R6, S5), the oracle of
``test_mass``.

Written from the MASS paper (Song et al. 2019) and docs/design/families.md#mass, not
from ``exactstep.families.mass.compiler``: plain lists and loops. The only thing taken
from outside is the stream of random draws, the very generator the compiler addresses
(``numpy.random.default_rng([seed, MASS_STREAM, epoch, example_id, piece])``), read in
the documented order: the start, ``k`` uniforms, ``k`` random-token indices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

IGNORE = -100
MASS_STREAM = 0x4D415353  # "MASS", written out


@dataclass(frozen=True)
class Rule:
    """The section's settings and the ids the rule needs."""

    fraction: float
    mask_rate: float
    random_rate: float
    mask: int
    bos: int
    eos: int
    pad: int
    content: tuple[int, ...]  # the non-special ids, ascending


def fragment_length(r: int, fraction: float) -> int:
    """MASS's fragment: half the sentence by default; here ``round(r * fraction)``, at
    least one token of a piece with content, never more than the piece."""
    if r == 0:
        return 0
    k = round(r * fraction)
    if k < 1:
        k = 1
    if k > r:
        k = r
    return k


class Draws:
    """One piece's draws, in the documented order."""

    def __init__(self, seed: int, epoch: int, example_id: int, piece: int) -> None:
        self.rng = np.random.default_rng([seed, MASS_STREAM, epoch, example_id, piece])

    def start(self, choices: int) -> int:
        return int(self.rng.integers(0, choices))

    def uniforms(self, k: int) -> list[float]:
        return [float(x) for x in self.rng.random(k)]

    def indices(self, n: int, k: int) -> list[int]:
        return [int(x) for x in self.rng.integers(0, n, size=k)]


def content_of(tokens: Sequence[int], offset: int, length: int) -> list[int]:
    """The piece's tokens without the example's first (BOS) and last (EOS) token."""
    start, stop = max(offset, 1), min(offset + length, len(tokens) - 1)
    return list(tokens[start:stop])


def mask_piece(raw: list[int], rule: Rule, draws: Draws,
               shift: int = 0) -> tuple[list[int], int, list[int]]:
    """``(encoder input with EOS, fragment start u, fragment)``. ``shift`` moves the
    fragment (a wrong variant for the negative control)."""
    r = len(raw)
    k = fragment_length(r, rule.fraction)
    if k == 0:
        return raw + [rule.eos], 0, []
    u = draws.start(r - k + 1)
    v = draws.uniforms(k)
    index = draws.indices(len(rule.content), k)
    u = min(max(u + shift, 0), r - k)
    inputs = list(raw)
    for i in range(k):
        if v[i] < rule.mask_rate:
            inputs[u + i] = rule.mask
        elif v[i] < rule.mask_rate + rule.random_rate:
            inputs[u + i] = rule.content[index[i]]
    return inputs + [rule.eos], u, raw[u:u + k]


@dataclass(frozen=True)
class PieceRef:
    tokens: list[int]
    offset: int
    length: int
    example_id: int
    piece: int
    epoch: int


def expected_sides(rows: Sequence[Sequence[PieceRef]], rule: Rule, *, seed: int, seq_len: int,
                   positions: str = "reset", shift: int = 0) -> dict[str, list[list[int]]]:
    """Every tensor of a MASS batch, as nested lists. Encoder: ``seq_len`` columns;
    decoder: the fragment of a full row (``seq_len - 1`` content tokens)."""
    width = max(fragment_length(seq_len - 1, rule.fraction), 1)
    out: dict[str, list[list[int]]] = {name: [] for name in (
        "enc_ids", "enc_pos", "enc_seg", "dec_ids", "dec_pos", "dec_seg", "labels")}
    for row in rows:
        enc: dict[str, list[int]] = {"ids": [], "pos": [], "seg": []}
        dec: dict[str, list[int]] = {"ids": [], "pos": [], "seg": [], "labels": []}
        for s, p in enumerate(row, start=1):
            raw = content_of(p.tokens, p.offset, p.length)
            draws = Draws(seed, p.epoch, p.example_id, p.piece)
            inputs, u, fragment = mask_piece(raw, rule, draws, shift)
            first = len(enc["ids"])
            pos = [j if positions == "reset" else first + j for j in range(len(inputs))]
            enc["ids"] += inputs
            enc["pos"] += pos
            enc["seg"] += [s] * len(inputs)
            if not fragment:
                dec["ids"].append(rule.mask)
                dec["labels"].append(IGNORE)
                dec["pos"].append(pos[0])
                dec["seg"].append(s)
                continue
            for i, token in enumerate(fragment):
                dec["ids"].append(rule.mask if i == 0 else fragment[i - 1])
                dec["labels"].append(token)
                dec["pos"].append(pos[u + i])
                dec["seg"].append(s)
        assert len(enc["ids"]) <= seq_len and len(dec["ids"]) <= width, "the row overflows"
        for name, side, n, fill in (("enc_ids", enc["ids"], seq_len, rule.pad),
                                    ("enc_pos", enc["pos"], seq_len, 0),
                                    ("enc_seg", enc["seg"], seq_len, 0),
                                    ("dec_ids", dec["ids"], width, rule.pad),
                                    ("dec_pos", dec["pos"], width, 0),
                                    ("dec_seg", dec["seg"], width, 0),
                                    ("labels", dec["labels"], width, IGNORE)):
            out[name].append(side + [fill] * (n - len(side)))
    return out
