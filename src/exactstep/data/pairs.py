"""Paired data for the encoder-decoder families (R8): (source text, target text).

Two sources: ``"numwords"``, a built-in generated digits-to-English-words task, and a
JSON Lines file of ``{"source": ..., "target": ...}`` objects. Each is split by a hash
(whatever the seed), and ``pairs_fingerprint`` is the fingerprint the manifest records.
Design and derivations: docs/design/data.md#datapairspy (R8, S1, L3).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exactstep.data.jsonl import json_type, records, unicode_text
from exactstep.data.weights import parse_weight
from exactstep.errors import DataError

NUMWORDS_SOURCE = "numwords"
HOLDOUT_BUCKETS = 10

ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
SCALES = ((10**9, "billion"), (10**6, "million"), (1000, "thousand"))


@dataclass(frozen=True)
class Pair:
    """One (source, target) example; ``name`` is its stable identity (used by splits)."""

    source: str
    target: str
    name: str = ""
    weight: float | None = None

    def to_json(self) -> dict:
        out = {"source": self.source, "target": self.target}
        if self.weight is not None:
            out["weight"] = self.weight
        return out


def number_words(n: int) -> str:
    """``n`` (0 <= n < 10^12) in English words: ``"one thousand two hundred thirty-four"``
    (no "and", hyphenated tens, scale words thousand/million/billion)."""
    if not 0 <= n < 10**12:
        raise ValueError(f"number_words covers 0 <= n < 10^12; got {n}")
    if n == 0:
        return "zero"
    words = []
    for scale, name in SCALES:
        if n >= scale:
            words += [_below_thousand(n // scale), name]
            n %= scale
    if n:
        words.append(_below_thousand(n))
    return " ".join(words)


def _below_thousand(n: int) -> str:
    hundreds, rest = divmod(n, 100)
    words = [f"{ONES[hundreds]} hundred"] if hundreds else []
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(TENS[tens] + (f"-{ONES[ones]}" if ones else ""))
    elif rest:
        words.append(ONES[rest])
    return " ".join(words)


def is_heldout_number(n: int) -> bool:
    """The hash split of the numwords task (independent of the seed)."""
    return hashlib.sha256(str(n).encode("ascii")).digest()[0] % HOLDOUT_BUCKETS == 0


def numwords_pairs(seed: int, n: int, *, split: str, max_value: int) -> list[Pair]:
    """``n`` pairs of ``split`` (``"train"``: drawn with replacement; ``"heldout"``:
    distinct), numbers uniform in ``[0, max_value]``, deterministic in ``seed``. A
    number is held out exactly when the hash of its digits falls in bucket 0 of
    ``HOLDOUT_BUCKETS``, whatever the seed, so no held-out number is a training pair.

    Raises ``DataError`` when the split has fewer distinct numbers than a held-out
    ``n`` asks for (or none at all).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"numwords split must be 'train' or 'heldout'; got {split!r}")
    heldout = split == "heldout"
    numbers = np.array([k for k in range(max_value + 1) if is_heldout_number(k) == heldout],
                       dtype=np.int64)
    if len(numbers) == 0 or (heldout and len(numbers) < n):
        raise DataError(
            f"numwords: the {split} split of 0..{max_value} has {len(numbers)} numbers, "
            f"fewer than the {n} asked for; raise encdec.max_value or lower encdec.n_heldout"
        )
    rng = np.random.default_rng([seed, int(heldout)])
    chosen = (rng.choice(numbers, size=n, replace=False) if heldout
              else rng.choice(numbers, size=n, replace=True))
    return [Pair(str(int(k)), number_words(int(k)), name=f"numwords:{split}:{i}")
            for i, k in enumerate(chosen)]


def load_pairs_jsonl(path: str | Path) -> list[Pair]:
    """Every ``{"source": str, "target": str[, "weight": number]}`` line of ``path``.

    Raises ``DataError`` naming ``<file>:<line>`` for a line that is not such an object
    (or has an empty side), and for a file with no pairs.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.source {str(path)!r} is not 'numwords' or an existing "
                        "JSONL file of {\"source\": ..., \"target\": ...} lines")
    out = []
    for record in records(path):
        value, where = record.value, record.where
        if not isinstance(value, dict):
            raise DataError(f"{where}: expected an object with \"source\" and \"target\"; "
                            f"got a JSON {json_type(value)}")
        sides = []
        for key in ("source", "target"):
            text = value.get(key)
            if not isinstance(text, str) or not text:
                got = "nothing" if key not in value else f"a JSON {json_type(text)}"
                if isinstance(text, str):
                    got = "an empty string"
                raise DataError(f"{where}: \"{key}\" must be a non-empty string; got {got}")
            sides.append(unicode_text(text, where, f'"{key}"'))
        out.append(Pair(sides[0], sides[1], name=f"{path.name}:{record.number}",
                        weight=parse_weight(value, where)))
    if not out:
        raise DataError(f"{path} holds no pairs; add {{\"source\": ..., \"target\": ...}} lines")
    return out


def is_val_pair(pair: Pair, val_fraction: float) -> bool:
    """Hash split: the pair's content alone decides its split (stable across runs)."""
    canonical = json.dumps([pair.source, pair.target], ensure_ascii=False)
    bucket = int.from_bytes(hashlib.sha256(canonical.encode()).digest()[:8], "big")
    return bucket / 2**64 < val_fraction


def pairs_fingerprint(train: Sequence[Pair], val: Sequence[Pair]) -> str:
    """sha256 over the canonical JSON lines of both splits, tagged (S1)."""
    h = hashlib.sha256()
    for tag, pairs in ((b"train", train), (b"val", val)):
        h.update(tag + len(pairs).to_bytes(8, "big"))
        for pair in pairs:
            h.update(json.dumps(pair.to_json(), sort_keys=True, ensure_ascii=False).encode())
            h.update(b"\n")
    return h.hexdigest()
