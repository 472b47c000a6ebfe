"""A plain-Python statement of T5 span corruption and of span rows (R1, R3, R8).

Written from T5's definitions (``random_spans_noise_mask``, ``_random_segmentation``,
``noise_span_to_unique_sentinel``, ``nonnoise_span_to_unique_sentinel``,
``random_spans_helper``), not from ``exactstep.families.span.compiler``. No NumPy and no torch in
the logic: the only thing taken from outside is the stream of random draws, which
the caller hands in as ``draw(n) -> list[int]`` (a permutation of ``range(n)``), so
the oracle can consume the very draws the compiler's generator makes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

IGNORE = -100
SPAN_STREAM = 0x5350414E  # the family's tag, written out

Draw = Callable[[int], list[int]]


def t5_random_spans_helper(inputs_length: int, noise_density: float, mean_noise_span_length: float,
                           extra_in: int = 1, extra_out: int = 1) -> tuple[int, int]:
    """T5's ``random_spans_helper`` as T5 writes it (lengths include one EOS each)."""
    def to_lengths(tokens_length: int) -> tuple[int, int]:
        num_noise_tokens = int(round(tokens_length * noise_density))
        num_nonnoise_tokens = tokens_length - num_noise_tokens
        num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
        return (num_nonnoise_tokens + num_noise_spans * extra_in + 1,
                num_noise_tokens + num_noise_spans * extra_out + 1)

    tokens_length = inputs_length - 1
    while to_lengths(tokens_length + 1)[0] <= inputs_length:
        tokens_length += 1
    inputs_length, targets_length = to_lengths(tokens_length)
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def counts(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """T5's noise token and noise span counts (after its clamps); (0, 0) below 2."""
    if length < 2:
        return 0, 0
    num_noise = int(round(length * noise_density))
    num_noise = min(max(num_noise, 1), length - 1)
    num_spans = int(round(num_noise / mean_noise_span_length))
    num_spans = max(num_spans, 1)
    return num_noise, min(num_spans, length - num_noise)


def segmentation(num_items: int, num_segments: int, draw: Draw) -> list[int]:
    """Positive parts summing to ``num_items``: T5 shuffles ``num_segments - 1`` ones
    among ``num_items - 1`` gap slots; here the shuffle is one permutation of the
    slots, whose first ``num_segments - 1`` entries are the slots set to one."""
    order = draw(num_items - 1)
    first_in_segment = [0] * num_items  # T5 pads one leading 0
    for slot in order[: num_segments - 1]:
        first_in_segment[slot + 1] = 1
    lengths = [0] * num_segments
    segment = 0
    for item in range(num_items):
        segment += first_in_segment[item]
        lengths[segment] += 1
    return lengths


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            draw: Draw) -> list[bool]:
    num_noise, num_spans = counts(length, noise_density, mean_noise_span_length)
    if num_spans == 0:
        return [False] * length
    noise_lengths = segmentation(num_noise, num_spans, draw)
    nonnoise_lengths = segmentation(length - num_noise, num_spans, draw)
    mask: list[bool] = []
    for kept, noise in zip(nonnoise_lengths, noise_lengths, strict=True):
        mask += [False] * kept + [True] * noise
    return mask


def span_to_unique_sentinel(tokens: Sequence[int], mask: Sequence[bool],
                            sentinel: Callable[[int], int]) -> list[int]:
    """Each run of masked tokens becomes one sentinel, the ``k``-th run ``sentinel(k)``."""
    out: list[int] = []
    runs = 0
    for j, (token, masked) in enumerate(zip(tokens, mask, strict=True)):
        if not masked:
            out.append(token)
        elif j == 0 or not mask[j - 1]:
            out.append(sentinel(runs))
            runs += 1
    return out


def corrupt(raw: Sequence[int], mask: Sequence[bool], sentinel: Callable[[int], int],
            eos: int) -> tuple[list[int], list[int]]:
    """T5's inputs and targets (each with its appended EOS)."""
    inputs = span_to_unique_sentinel(raw, mask, sentinel) + [eos]
    targets = span_to_unique_sentinel(raw, [not m for m in mask], sentinel) + [eos]
    return inputs, targets


def reconstruct(inputs: Sequence[int], targets: Sequence[int], sentinels: set[int]) -> list[int]:
    """Raw tokens from both sides: each input sentinel replaced by what follows the same
    sentinel in the target. Raises ``AssertionError`` on a malformed pair."""
    assert inputs[-1] == targets[-1], "both sides end with the same EOS"
    spans: dict[int, list[int]] = {}
    current: list[int] | None = None
    for token in targets[:-1]:
        if token in sentinels:
            assert token not in spans, f"sentinel {token} used twice in the target"
            current = spans[token] = []
        else:
            assert current is not None, "the target starts with a sentinel"
            current.append(token)
    out: list[int] = []
    used = []
    for token in inputs[:-1]:
        if token in sentinels:
            assert token not in used, f"sentinel {token} used twice in the input"
            used.append(token)
            out += spans[token]
        else:
            out.append(token)
    assert set(used) <= set(spans), "the input names a sentinel the target lacks"
    # below two raw tokens T5 noises nothing but still marks the one non-noise span
    assert all(not spans[s] for s in spans if s not in used), "a target span has no gap"
    return out


def raw_of(tokens: Sequence[int], offset: int, length: int) -> list[int]:
    """The piece's tokens without the example's first (BOS) and last (EOS) token."""
    start, stop = max(offset, 1), min(offset + length, len(tokens) - 1)
    return list(tokens[start:stop])


def expected_sides(pieces_by_row: Sequence[Sequence[tuple[list[int], int, int]]],
                   draws: Callable[[int, int], Draw], *, seq_len: int, noise_density: float,
                   mean_noise_span_length: float, sentinel: Callable[[int], int], bos: int,
                   eos: int, pad: int) -> dict[str, list[list[int]]]:
    """Every tensor of a span batch, as nested lists. A piece is ``(example tokens,
    offset, length)`` with a key ``(row, index)`` for ``draws(row, index)``, the
    piece's own draw stream. Encoder: ``seq_len`` columns; decoder: T5's targets
    length; positions restart per segment; pieces left to right on both sides."""
    _, width = t5_random_spans_helper(seq_len, noise_density, mean_noise_span_length)
    out = {name: [] for name in ("enc_ids", "enc_pos", "enc_seg", "dec_ids", "dec_pos",
                                 "dec_seg", "labels")}
    for b, row in enumerate(pieces_by_row):
        enc = {"ids": [], "pos": [], "seg": []}
        dec = {"ids": [], "pos": [], "seg": [], "labels": []}
        for s, (tokens, offset, length) in enumerate(row):
            raw = raw_of(tokens, offset, length)
            mask = random_spans_noise_mask(len(raw), noise_density, mean_noise_span_length,
                                           draws(b, s))
            inputs, targets = corrupt(raw, mask, sentinel, eos)
            enc["ids"] += inputs
            enc["pos"] += list(range(len(inputs)))
            enc["seg"] += [s + 1] * len(inputs)
            dec["ids"] += [bos] + targets[:-1]
            dec["labels"] += targets
            dec["pos"] += list(range(len(targets)))
            dec["seg"] += [s + 1] * len(targets)
        assert len(enc["ids"]) <= seq_len and len(dec["ids"]) <= width, "the row overflows"
        out["enc_ids"].append(enc["ids"] + [pad] * (seq_len - len(enc["ids"])))
        out["enc_pos"].append(enc["pos"] + [0] * (seq_len - len(enc["pos"])))
        out["enc_seg"].append(enc["seg"] + [0] * (seq_len - len(enc["seg"])))
        out["dec_ids"].append(dec["ids"] + [pad] * (width - len(dec["ids"])))
        out["dec_pos"].append(dec["pos"] + [0] * (width - len(dec["pos"])))
        out["dec_seg"].append(dec["seg"] + [0] * (width - len(dec["seg"])))
        out["labels"].append(dec["labels"] + [IGNORE] * (width - len(dec["labels"])))
    return out
