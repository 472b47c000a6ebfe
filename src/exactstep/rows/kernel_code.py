"""The compiled kernels of ``rows.kernels`` (whose doc gives the layouts): numba
``njit`` functions, cached on disk, run without the GIL. Imported on first use
through ``rows.kernels``, so that a process that never packs never loads numba."""

from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils
from numba.extending import intrinsic

from exactstep.rows.kernels import (
    ADMITTED,
    ARRIVAL,
    COLUMN,
    CURSOR,
    DOCUMENTS,
    DROP,
    DROPPED_DOCUMENTS,
    DROPPED_LOST,
    DROPPED_TOKENS,
    EXAMPLE,
    FILL_TO,
    FREE,
    IGNORE,
    INDEX_AT,
    INDEX_SIZE,
    LENGTH,
    NEXT,
    NEXT_ARRIVAL,
    OFFSET,
    OVERLAP,
    OWNED_AT,
    OWNED_SIZE,
    PIECE,
    PLAIN,
    REAL,
    ROWS,
    RULE,
    SEQ_LEN,
    SPLIT,
    SPLIT_DOCUMENTS,
    SPLIT_LOST,
    SPLIT_PIECES,
    SPLIT_REPEATED,
    TARGETS,
    TOKENS,
    TOKENS_AT,
    TOKENS_SIZE,
    TRUNCATE,
    TRUNCATED_DOCUMENTS,
    TRUNCATED_LOST,
    TRUNCATED_TOKENS,
    N,
)


def kernel(fn):
    """``fn`` compiled: numba ``njit``, cached on disk, without the GIL."""
    return numba.njit(cache=True, nogil=True)(fn)


@intrinsic
def _pointer(typingctx, address):
    """The integer ``address`` as a raw pointer (for ``numba.carray``)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return numba.types.voidptr(address), codegen


@kernel
def memory(address, size, sample):
    """The ``size`` elements of ``sample``'s dtype at ``address`` as an array: how a
    kernel reads a shard's memory map from ``MAP_FIELDS`` (its owner keeps the map
    alive)."""
    return numba.carray(_pointer(address), (size,), sample.dtype)


@kernel
def push_piece(slots, queues, bits, free, state, charge, example, offset, length, piece):
    """A new pending piece of cost ``charge`` (the next arrival), at the tail of its
    cost's queue; a free slot is the caller's to provide."""
    top = state[FREE] - 1
    slot = free[top]
    state[FREE] = top
    slots[EXAMPLE, slot] = example
    slots[OFFSET, slot] = offset
    slots[LENGTH, slot] = length
    slots[PIECE, slot] = piece
    slots[ARRIVAL, slot] = state[NEXT_ARRIVAL]
    slots[NEXT, slot] = -1
    state[NEXT_ARRIVAL] += 1
    state[N] += 1
    tail = queues[1, charge]
    if tail < 0:
        queues[0, charge] = slot
        bits[charge >> 5] |= 1 << (charge & 31)
    else:
        slots[NEXT, tail] = slot
    queues[1, charge] = slot


@kernel
def highest_cost(bits, space):
    """The highest cost at most ``space`` with a pending piece, or -1."""
    w = space >> 5
    word = bits[w] & ((2 << (space & 31)) - 1)
    while word == 0:
        w -= 1
        if w < 0:
            return -1
        word = bits[w]
    high = 0
    for shift in (16, 8, 4, 2, 1):
        if word >> shift:
            high += shift
            word >>= shift
    return (w << 5) + high


@kernel
def pop_head(slots, queues, bits, free, state, charge):
    """Remove the head (earliest arrival) of cost ``charge``'s queue; its slot, whose
    fields stay readable until the next push."""
    slot = queues[0, charge]
    following = slots[NEXT, slot]
    queues[0, charge] = following
    if following < 0:
        queues[1, charge] = -1
        bits[charge >> 5] &= ~(1 << (charge & 31))
    slots[ARRIVAL, slot] = -1
    free[state[FREE]] = slot
    state[FREE] += 1
    state[N] -= 1
    return slot


@kernel
def admit_run(slots, queues, bits, free, state, cost, window, counts, settings):
    """Admit the examples of ``window`` (``[ids, lengths, targets]`` of the epoch
    order) from ``state[CURSOR]`` on until the buffer holds ``settings[FILL_TO]``
    pieces or the window ends. An example that fits is one piece; an over-long one
    is cut here (``rows.packing.cut_example``'s rule) when ``settings[PLAIN]`` (every
    token but the first is a target: text) and there are free slots for its pieces,
    else left for the planner. Returns whether the buffer is full."""
    rule, overlap, plain = settings[RULE], settings[OVERLAP], settings[PLAIN]
    seq_len, fill_to = settings[SEQ_LEN], settings[FILL_TO]
    j = state[CURSOR]
    width = window.shape[1]
    while state[N] < fill_to and j < width:
        doc, length, targets = window[0, j], window[1, j], window[2, j]
        if length <= seq_len:
            if state[FREE] < 1:
                break
            push_piece(slots, queues, bits, free, state, cost[length], doc, 0, length, 0)
            counts[ADMITTED] += 1
        else:
            stride = seq_len - 1 if overlap else seq_len
            if rule == SPLIT:
                pieces = (length - 2 + stride) // stride if overlap else (
                    (length + seq_len - 1) // seq_len)
            else:
                pieces = 0 if rule == DROP else 1
            if not plain or state[FREE] < pieces:
                break
            if rule == DROP:
                counts[DROPPED_DOCUMENTS] += 1
                counts[DROPPED_TOKENS] += length
                counts[DROPPED_LOST] += length - 1
            elif rule == TRUNCATE:
                counts[TRUNCATED_DOCUMENTS] += 1
                counts[TRUNCATED_TOKENS] += length - seq_len
                counts[TRUNCATED_LOST] += length - seq_len
            else:
                counts[SPLIT_DOCUMENTS] += 1
                counts[SPLIT_PIECES] += pieces
                counts[SPLIT_LOST] += 0 if overlap else pieces - 1
                counts[SPLIT_REPEATED] += (pieces - 1) if overlap else 0
            for k in range(pieces):
                start = k * stride if rule == SPLIT else 0
                size = min(seq_len, length - start)
                push_piece(slots, queues, bits, free, state, cost[size], doc, start, size, k)
            counts[ADMITTED] += pieces
        counts[DOCUMENTS] += 1
        counts[TOKENS] += length
        counts[TARGETS] += targets
        j += 1
    state[CURSOR] = j
    return state[N] >= fill_to


@kernel
def plan_rows(slots, queues, bits, free, state, cost, window, out, row_starts, counts,
              settings, rows_wanted, refill_first):
    """Up to ``rows_wanted`` rows, each after refilling the buffer (``admit_run``;
    the first row skips it unless ``refill_first``), best fit decreasing
    (``rows.packing``). Appends the rows' pieces to ``out`` from ``row_starts[0]``
    on and returns ``(rows made, needs help)``: help (the window ends, an over-long
    example to cut, the end of the epoch, no free slot) is the planner's, in
    Python. ``state`` and ``counts`` are updated in place."""
    seq_len = settings[SEQ_LEN]
    p = row_starts[0]
    rows = 0
    while rows < rows_wanted:
        if refill_first and not admit_run(slots, queues, bits, free, state, cost, window,
                                          counts, settings):
            return rows, True
        refill_first = True
        space = seq_len
        column = 0
        while space > 0 and state[N] > 0:
            charge = highest_cost(bits, space)  # the longest pending piece that fits
            if charge < 0:
                break
            slot = pop_head(slots, queues, bits, free, state, charge)  # earliest arrival
            out[0, p] = slots[EXAMPLE, slot]
            out[1, p] = slots[OFFSET, slot]
            out[2, p] = slots[LENGTH, slot]
            out[3, p] = slots[PIECE, slot]
            out[COLUMN, p] = column
            column += slots[LENGTH, slot]
            p += 1
            space -= charge
        rows += 1
        row_starts[rows] = p
        counts[ROWS] += 1
        counts[REAL] += column
    return rows, False


@kernel
def fill_causal(maps, sample, chat, shard_starts, plan, row_starts, seq_len, pad_id, keep,
                reset, ramp, input_ids, labels, position_ids, segment_ids):
    """The causal arrays (``rows.causal``'s semantics) of the rows of ``plan`` over
    prepared shards (``maps[k]``: shard ``k``'s memory, ``MAP_FIELDS``; tokens of
    ``sample``'s dtype; packed ownership bits read when ``chat``), written row-major
    into the ``[rows * seq_len]`` outputs; ``ramp`` is ``arange(seq_len)``. Returns
    -1, or the first piece that lies outside its document or its shard (the
    outputs are then not to be used)."""
    rows = len(row_starts) - 1
    documents = shard_starts[len(shard_starts) - 1]
    none = np.zeros(0, dtype=np.uint8)
    for r in range(rows):
        base = r * seq_len
        first, stop = row_starts[r], row_starts[r + 1]
        used = 0
        for q in range(first, stop):
            doc, offset, length, column = plan[0, q], plan[1, q], plan[2, q], plan[COLUMN, q]
            if doc < 0 or doc >= documents or length < 1:
                return q
            k = np.searchsorted(shard_starts, doc, side="right") - 1
            row = 3 * (doc - shard_starts[k])
            shard = maps[k]
            index = memory(shard[INDEX_AT], shard[INDEX_SIZE], shard_starts)
            if offset < 0 or offset + length > index[row + 1]:
                return q
            a = index[row] + offset
            if a + length > shard[TOKENS_SIZE]:
                return q
            tokens = memory(shard[TOKENS_AT], shard[TOKENS_SIZE], sample)
            owned = memory(shard[OWNED_AT], shard[OWNED_SIZE], none) if chat else none
            s = base + column
            input_ids[s: s + length] = tokens[a: a + length]
            labels[s: s + length - 1] = tokens[a + 1: a + length]
            if chat:  # a label only where its token is an owned target (R5)
                for t in range(length - 1):
                    b = a + t + 1
                    if not (owned[b >> 3] >> (7 - (b & 7))) & 1:
                        labels[s + t] = IGNORE
            labels[s + length - 1] = IGNORE
            if reset:
                position_ids[s: s + length] = ramp[:length]
            else:
                position_ids[s: s + length] = ramp[column: column + length]
            segment_ids[s: s + length] = q - first + 1
            used = column + length
        input_ids[base + used: base + seq_len] = pad_id
        labels[base + used: base + seq_len] = IGNORE
        position_ids[base + used: base + seq_len] = 0
        segment_ids[base + used: base + seq_len] = 0
        if keep:  # a kept boundary: the next segment's first token, owned or not
            for q in range(first, stop - 1):
                last = base + plan[COLUMN, q] + plan[2, q] - 1
                labels[last] = input_ids[last + 1]
    return -1


@kernel
def screen(input_ids, labels, segment_ids, seq_len, vocab_size, ignore_boundary,
           next_token):
    """``rows.invariants.is_clean`` over the flattened ``[B * T]`` arrays: whether no
    R7 condition can hold (``vocab_size < 0``: no upper bound on ids). A supervised
    slot is compared with the next slot along the flattened rows; a row's last
    column, where that would be the next row's first, is refused outright when
    supervised (under either rule that compares)."""
    slots = len(input_ids)
    upper = np.uint64(vocab_size) if vocab_size >= 0 else np.uint64(1) << np.uint64(63)
    highest = np.uint64(0)  # a negative id is >= 2**63 as unsigned
    for s in range(slots):
        highest = max(highest, np.uint64(input_ids[s]))
    if highest >= upper:
        return False
    if not next_token:
        for s in range(slots):
            if labels[s] != IGNORE and np.uint64(labels[s]) >= upper:
                return False
    if ignore_boundary or next_token:
        for last in range(seq_len - 1, slots, seq_len):
            if labels[last] != IGNORE:
                return False
    for s in range(slots - 1):
        if labels[s] != IGNORE:
            if segment_ids[s] == 0:
                return False
            if ignore_boundary and segment_ids[s] != segment_ids[s + 1]:
                return False
            if next_token and labels[s] != input_ids[s + 1]:
                return False
    return slots == 0 or labels[slots - 1] == IGNORE or segment_ids[slots - 1] != 0


@kernel
def count_supervised(labels):
    """How many of ``labels`` (flattened) are not ``IGNORE``."""
    n = 0
    for s in range(len(labels)):
        n += labels[s] != IGNORE
    return n
