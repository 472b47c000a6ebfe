"""Compiled kernels of the hot data path (P2, R4, R7): the planner's best-fit
buffer, the causal compiler over prepared shards, and the R7 screen.

Each kernel is plain Python over NumPy arrays and ints in ``rows.kernel_code``,
compiled by numba (``njit``, cached on disk after the first use, ``nogil`` so a
loader thread packs while the step holds the GIL). This module holds the layouts
the kernels and their callers share, and loads the kernels (and numba) on first
use: ``kernels.plan_rows`` and the others. Their callers own the semantics and
document them:
``rows.packing`` (the plan), ``rows.causal`` (labels, positions, segment ids) and
``rows.invariants`` (what R7 refuses); the kernels are tested against those
modules' NumPy and pure-Python forms, and against the golden digests of
``tests/rows/test_stream_golden.py``.

The planner's buffer (``rows.packing``: the pending pieces, best fit by cost,
earliest arrival on ties) is a queue per cost: ``slots[SLOT_FIELDS, capacity]``
holds each pending piece's ``EXAMPLE``, ``OFFSET``, ``LENGTH``, ``PIECE``,
``ARRIVAL`` (-1 for a free slot) and ``NEXT`` (the next slot of its cost's queue,
-1 at the tail); ``queues[0, c]`` / ``queues[1, c]`` are the head and tail slot of
cost ``c`` (-1 when empty); bit ``c & 31`` of ``bits[c >> 5]`` says that cost
``c`` has a pending piece; ``free[:state[FREE]]`` are the free slots. A piece
joins the tail of its cost's queue (arrivals only grow), so each queue is in
arrival order, and the best fit for ``space`` is the head of the highest set bit
at most ``space``. A plan ``out[PLAN_FIELDS, m]`` lists placed pieces in row
order: example, offset, length, piece and ``COLUMN`` (the piece's first column
in its row), with ``row_starts[r]`` the first piece of row ``r``.
"""

from __future__ import annotations

ARRIVAL_BITS = 40  # arrivals stay below 2 ** ARRIVAL_BITS (a saved state is checked)
IGNORE = -100  # rows.batch.IGNORE_INDEX (rows.batch imports torch; kernels do not)

EXAMPLE, OFFSET, LENGTH, PIECE, ARRIVAL, NEXT = range(6)  # rows of ``slots``
SLOT_FIELDS = 6
COLUMN = 4  # a plan's rows: example, offset, length, piece, column
PLAN_FIELDS = 5
# the planner's kernel state: pending pieces, position in the window, next arrival,
# free slots
N, CURSOR, NEXT_ARRIVAL, FREE = range(4)
STATE_FIELDS = 4
# the settings: over-long rule, overlap_split, plain (every token but the first is
# a target), seq_len, buffer (the pieces to refill to)
RULE, OVERLAP, PLAIN, SEQ_LEN, FILL_TO = range(5)
# the counts a plan adds to: rows.packing.PackCounts's fields in order, then the
# pieces admitted (the planner's admitted_this_epoch)
COUNTS = ("documents", "tokens", "targets", "split_documents", "split_pieces",
          "split_targets_lost", "split_repeated_tokens", "truncated_documents",
          "truncated_tokens", "truncated_targets_lost", "dropped_documents", "dropped_tokens",
          "dropped_targets_lost", "rows", "real_tokens", "admitted")
(DOCUMENTS, TOKENS, TARGETS, SPLIT_DOCUMENTS, SPLIT_PIECES, SPLIT_LOST, SPLIT_REPEATED,
 TRUNCATED_DOCUMENTS, TRUNCATED_TOKENS, TRUNCATED_LOST, DROPPED_DOCUMENTS, DROPPED_TOKENS,
 DROPPED_LOST, ROWS, REAL, ADMITTED) = range(len(COUNTS))
SPLIT, TRUNCATE, DROP = 0, 1, 2  # the over-long policies (rows.packing.cut_example)
# a shard's maps as a kernel reads them (rows.prepared.ShardMaps): the address and
# element count of its tokens, of its index ([documents, 3] int64, flattened) and
# of its packed ownership bits
TOKENS_AT, TOKENS_SIZE, INDEX_AT, INDEX_SIZE, OWNED_AT, OWNED_SIZE = range(6)
MAP_FIELDS = 6

KERNELS = ("memory", "push_piece", "highest_cost", "pop_head", "admit_run", "plan_rows",
           "fill_causal", "screen", "count_supervised")


def __getattr__(name: str):
    """The compiled kernels, loaded with numba on first use (module doc)."""
    if name not in KERNELS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from exactstep.rows import kernel_code

    for kernel in KERNELS:
        globals()[kernel] = getattr(kernel_code, kernel)
    return globals()[name]
