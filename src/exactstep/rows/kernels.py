"""Compiled kernels of the hot data path (P2, R4, R7).

The planner's best-fit buffer, the causal compiler over prepared shards (which
screens, counts and addresses the batch it writes in the same call) and the R7
screen, in C (``kernels.c``, built as ``rows._kernels``) called without the GIL. This
module holds the layouts shared with the callers, loads the library (a missing build
is an ``ImportError``) and makes each call memory-safe; the callers own the semantics.
Design and derivations: docs/design/rows.md#rowskernelspy (P2, R4, R7).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import importlib.util
from pathlib import Path

import numpy as np
import torch

ARRIVAL_BITS = 40  # arrivals stay below 2 ** ARRIVAL_BITS (a saved state is checked)
IGNORE = -100  # rows.batch.IGNORE_INDEX (rows.batch imports this module)

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

MALFORMED = -2  # the causal fill: row starts that do not begin at 0 and rise within the plan
# the planner's frame (PieceBuffer.frame): the addresses and sizes of the buffer's
# arrays, then the kernel's answer of whether the planner must act
(F_SLOTS, F_CAP, F_QUEUES, F_COSTS, F_BITS, F_FREE, F_STATE, F_COST, F_WINDOW, F_WIDTH,
 F_OUT, F_OUT_CAP, F_STARTS, F_COUNTS, F_SETTINGS, F_HELP) = range(16)
PLAN_FRAME = 16
# a fused causal fill's settings (CausalFill.frame)
(X_TABLE, X_STARTS, X_SHARDS, X_CHAT, X_TOKEN_SIZE, X_SEQ_LEN, X_PAD_ID, X_KEEP, X_RESET,
 X_SCREEN, X_VOCAB, X_IGNORE_BOUNDARY, X_NEXT_TOKEN) = range(13)
FILL_FRAME = 13

# the constants kernels.c must agree with, in the order its layout() writes them
LAYOUT = (IGNORE, SLOT_FIELDS, ARRIVAL, NEXT, COLUMN, PLAN_FIELDS, STATE_FIELDS, FREE,
          FILL_TO, len(COUNTS), ADMITTED, DROP, MAP_FIELDS, OWNED_SIZE, MALFORMED,
          PLAN_FRAME, F_HELP, FILL_FRAME, X_NEXT_TOKEN)


@functools.cache
def compiled_library() -> ctypes.CDLL:
    """The compiled kernels (``rows._kernels``), loaded once, prototypes set and
    layout checked. Raises ``ImportError`` naming the fix when it was not built."""
    spec = importlib.util.find_spec("exactstep.rows._kernels")
    if spec is None or not spec.origin or not spec.origin.endswith((".so", ".pyd")):
        raise ImportError("exactstep's compiled row kernels (exactstep/rows/_kernels) are "
                          "not built; install exactstep again with a C compiler present "
                          "(pip install -e . or pip install .)")
    lib = ctypes.CDLL(spec.origin)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    prototypes = {
        "source_sha256": (ctypes.c_char_p, []),
        "layout": (None, [ptr]),
        "push_framed": (None, [ptr, i64, i64, i64, i64, i64]),
        "admit_framed": (ctypes.c_int, [ptr]),
        "plan_framed": (i64, [ptr, i64, i64, i64]),
        "fill_screened": (i64, [ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ptr]),
        "screen": (i64, [ptr, ptr, ptr, i64, i64, i64, i64, i64, i64]),
        "count_supervised": (i64, [ptr, i64]),
    }
    for name, (restype, argtypes) in prototypes.items():
        try:
            function = getattr(lib, name)
        except AttributeError:  # a library of an older version
            raise ImportError(f"exactstep's compiled row kernels do not match this version "
                              f"(no {name}); build them again: make, or pip install -e .") \
                from None
        function.restype, function.argtypes = restype, argtypes
    written = np.zeros(len(LAYOUT), dtype=np.int64)
    lib.layout(address(written))
    if tuple(written.tolist()) != LAYOUT:
        raise ImportError(f"exactstep's compiled row kernels do not match this version "
                          f"(layout {written.tolist()}, expected {list(LAYOUT)}); install "
                          "exactstep again")
    check_source(lib, Path(__file__).with_name("kernels.c"))
    return lib


def check_source(lib: ctypes.CDLL, source: Path) -> None:
    """Refuse a library built from another ``kernels.c`` than ``source`` (the file
    beside this module, where there is one: a source checkout; a wheel ships only the
    library): an edit or an update since the build would otherwise run the old C
    under the new Python, silently wherever the layout constants did not change."""
    if not source.is_file():
        return
    built = lib.source_sha256().decode()
    now = hashlib.sha256(source.read_bytes()).hexdigest()
    if built != now:
        raise ImportError(f"exactstep's compiled row kernels were built from another "
                          f"kernels.c (sha256 {built[:12] or 'unrecorded'}) than {source} "
                          f"({now[:12]}); build them again: make, or pip install -e .")


def address(array: np.ndarray, dtype=np.int64) -> int:
    """The data address of ``array``, which must be C-contiguous and of ``dtype``
    (the check that keeps a kernel inside the memory it is given)."""
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise ValueError(f"a kernel needs a contiguous {np.dtype(dtype)} array, "
                         f"not {array.dtype} of strides {array.strides}")
    if array.size and array.flags.writeable:  # the buffer protocol: a fraction of .ctypes
        return ctypes.addressof(_BYTE.from_buffer(array))
    return array.ctypes.data


_BYTE = ctypes.c_char * 1


class PieceBuffer:
    """The planner's pending pieces (layout: docs/design/rows.md#rowskernelspy)
    and the kernels that fill and empty
    them. ``cost`` is the charge of each piece length ``0..seq_len``; ``settings``
    ``[RULE, OVERLAP, PLAIN, SEQ_LEN, FILL_TO]``; ``counts`` (``COUNTS``) only ever
    grows, and ``state`` is ``[N, CURSOR, NEXT_ARRIVAL, FREE]``, ``CURSOR`` the
    position in ``window`` (``[ids, lengths, targets]``). ``plan`` writes rows into
    the buffer's plan arrays ``out`` and ``row_starts`` (the same layout), which
    ``planned`` copies out. The addresses and sizes of its arrays are kept in
    ``frame`` (``F_*``: the arrays are replaced, never resized in place, and each
    replacement writes the frame), so a kernel call passes one address."""

    def __init__(self, cost: np.ndarray, settings: np.ndarray, capacity: int) -> None:
        self.cost = np.ascontiguousarray(cost, dtype=np.int64)
        self.settings = np.ascontiguousarray(settings, dtype=np.int64)
        self.seq_len = int(self.settings[SEQ_LEN])
        self._unit_cost = bool(self.cost[1] >= 1)  # every piece costs at least 1
        self.state = np.zeros(STATE_FIELDS, dtype=np.int64)
        self.counts = np.zeros(len(COUNTS), dtype=np.int64)
        self.lib = compiled_library()
        self.frame = np.zeros(PLAN_FRAME, dtype=np.int64)
        self._at = address(self.frame)
        self.frame[[F_COST, F_STATE, F_COUNTS, F_SETTINGS, F_COSTS]] = (
            address(self.cost), address(self.state), address(self.counts),
            address(self.settings), self.seq_len + 1)
        self._set_plan(np.zeros((PLAN_FIELDS, 0), dtype=np.int64), np.zeros(1, dtype=np.int64))
        self.set_window(np.zeros((3, 0), dtype=np.int64))
        self.empty(capacity)

    def empty(self, capacity: int) -> None:
        """No pending piece, ``capacity`` slots; the next arrival is kept."""
        self.slots = np.full((SLOT_FIELDS, capacity), -1, dtype=np.int64)
        self.queues = np.full((2, self.seq_len + 1), -1, dtype=np.int64)
        self.bits = np.zeros((self.seq_len >> 5) + 1, dtype=np.int64)
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self.state[N] = 0
        self.state[FREE] = capacity
        self._located()

    def grow(self) -> None:
        """Twice the slots, the pending pieces where they are."""
        old = self.slots.shape[1]
        slots = np.full((SLOT_FIELDS, 2 * old), -1, dtype=np.int64)
        slots[:, :old] = self.slots
        free = np.empty(2 * old, dtype=np.int64)
        top = int(self.state[FREE])
        free[:top] = self.free[:top]
        free[top: top + old] = np.arange(2 * old - 1, old - 1, -1)
        self.slots, self.free = slots, free
        self.state[FREE] = top + old
        self._located()

    def _located(self) -> None:
        """The frame's entries for the buffer's arrays, after they were replaced."""
        self.frame[[F_SLOTS, F_CAP, F_QUEUES, F_BITS, F_FREE]] = (
            address(self.slots), self.slots.shape[1], address(self.queues), address(self.bits),
            address(self.free))

    def set_window(self, window: np.ndarray) -> None:
        """The next window of the epoch order (``[3, width]``); the cursor is 0."""
        self.window = np.ascontiguousarray(window, dtype=np.int64)
        self.frame[[F_WINDOW, F_WIDTH]] = address(self.window), self.window.shape[1]
        self.state[CURSOR] = 0

    def push(self, example: int, offset: int, length: int, piece: int) -> None:
        """A new pending piece (the next arrival), the buffer grown if it is full."""
        if not 1 <= length <= self.seq_len:
            raise ValueError(f"a piece of {length} tokens does not fit rows of {self.seq_len}")
        if self.state[FREE] < 1:
            self.grow()
        self.lib.push_framed(self._at, int(self.cost[length]), example, offset, length, piece)

    def admit(self) -> bool:
        """Admit from the window at the cursor (``admit`` in ``kernels.c``); whether
        the buffer is full."""
        return bool(self.lib.admit_framed(self._at))

    def plan(self, row: int, rows: int, refill_first: bool) -> tuple[int, bool]:
        """Up to ``rows`` more rows into the plan (``plan_rows``; ``planned`` copies
        it out) after its first ``row`` rows (0: a new plan): ``(rows made, needs
        help)``. The plan's arrays, ``out [PLAN_FIELDS, m]`` and ``row_starts``, are
        the buffer's own, grown before the call to hold any ``rows`` rows."""
        if row == 0:
            self.row_starts[0] = 0
        self._reserve(row, rows)
        made = self.lib.plan_framed(self._at, row, rows, refill_first)
        help_ = self.frame[F_HELP]
        if help_ < 0:
            raise RuntimeError("the plan outgrew its arrays; this is a bug in rows.packing")
        return made, bool(help_)

    def planned(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the plan's first ``rows`` rows: ``(pieces [PLAN_FIELDS, P],
        row_starts [rows + 1])``."""
        starts = self.row_starts[: rows + 1].copy()
        return self.out[:, : int(starts[rows])].copy(), starts

    def _reserve(self, row: int, rows: int) -> None:
        """Room in the plan for ``rows`` more rows after ``row``: a row holds at most
        every pending piece, and at most ``seq_len`` when each costs at least 1."""
        placed = int(self.row_starts[row])
        most = placed + rows * self._per_row()
        if most > self.out.shape[1] or row + rows >= len(self.row_starts):
            out = np.zeros((PLAN_FIELDS, max(most, self.out.shape[1])), dtype=np.int64)
            out[:, :placed] = self.out[:, :placed]
            starts = np.zeros(max(row + rows + 1, len(self.row_starts)), dtype=np.int64)
            starts[: row + 1] = self.row_starts[: row + 1]
            self._set_plan(out, starts)

    def _per_row(self) -> int:
        """The most pieces one row can take from the buffer as it is now."""
        slots = self.slots.shape[1]
        return min(slots, self.seq_len) if self._unit_cost else slots

    def _set_plan(self, out: np.ndarray, row_starts: np.ndarray) -> None:
        """The plan's new arrays, and the frame's entries for them."""
        self.out, self.row_starts = out, row_starts
        self.frame[[F_OUT, F_OUT_CAP, F_STARTS]] = address(out), out.shape[1], address(row_starts)


def pending_columns(slots: np.ndarray) -> list[list[int]]:
    """``[arrival, example, offset, length, piece]`` of the pending pieces held in
    ``slots`` (a ``PieceBuffer``'s, or a copy of them), each column in arrival order."""
    held = np.flatnonzero(slots[ARRIVAL] >= 0)
    held = held[np.argsort(slots[ARRIVAL, held], kind="stable")]
    return slots[[ARRIVAL, EXAMPLE, OFFSET, LENGTH, PIECE]][:, held].tolist()


class CausalFill:
    """The causal arrays of a plan over the shards of ``maps``
    (``rows.prepared.ShardMaps``), the R7 screen and the supervised count of the
    batch written, and the plan's segments, in one call (``causal_batch`` of
    ``kernels.c``: the fill, the screen and the count in turn, a row at a time,
    with the GIL released; then ``plan_segments``), for one stream's settings.
    ``screen``: ``(vocab_size, ignore_boundary, next_token)`` as ``screen`` takes
    them (``vocab_size`` -1: no upper bound), or ``None`` for no screen. The
    settings are a read-only ``frame`` (``X_*``), so one ``CausalFill`` may serve
    several threads."""

    def __init__(self, maps, seq_len: int, pad_id: int, keep: bool, reset: bool,
                 screen: tuple[int, bool, bool] | None) -> None:
        vocab, ignore_boundary, next_token = screen or (-1, False, False)
        self.maps = maps  # keeps the addresses of the frame alive
        self.frame = np.array([maps.table_address, maps.starts_address, maps.shards, maps.chat,
                               maps.sample.itemsize, seq_len, pad_id, keep, reset,
                               screen is not None, vocab, ignore_boundary, next_token],
                              dtype=np.int64)
        self.frame.flags.writeable = False
        self.seq_len = seq_len
        self._call = compiled_module().causal_batch

    def __call__(self, plan: np.ndarray, row_starts: np.ndarray,
                 kind: type) -> tuple[tuple, int, bool, int, tuple | None]:
        """``(tensors, bad, clean, count, segments)`` of ``plan`` (``[PLAN_FIELDS,
        P]``, int64) and ``row_starts``: the new host tensors ``[rows, seq_len]``
        ``input_ids``, ``labels``, ``position_ids`` (int64) and ``segment_ids``
        (int32); ``bad`` -1, or the first piece outside its document or shard (then
        nothing else was computed: ``clean`` False, ``count`` 0, ``segments``
        ``None``); ``clean`` whether the screen found nothing (False without a
        screen); ``count`` the labels that are not ``IGNORE``; ``segments`` each
        row's tuple of ``kind`` (``plan_segments``). ``ValueError`` for arrays of
        another kind or shape, or row starts that do not begin at 0 and rise within
        the plan."""
        rows = len(row_starts) - 1
        if rows < 0:
            raise ValueError("the causal fill needs row starts from 0, rising within the plan")
        empty, int64, seq_len = torch.empty, torch.int64, self.seq_len
        outputs = (empty(rows, seq_len, dtype=int64), empty(rows, seq_len, dtype=int64),
                   empty(rows, seq_len, dtype=int64), empty(rows, seq_len, dtype=torch.int32))
        answer, segments = self._call(self.frame, plan, row_starts,
                                      *[t.data_ptr() for t in outputs], kind)
        if answer >= 0:
            return outputs, -1, bool(answer & 1), answer >> 1, segments
        if answer == MALFORMED:
            raise ValueError("the causal fill needs row starts from 0, rising within the plan")
        return outputs, -3 - answer, False, 0, None


def plan_segments(pieces: np.ndarray, row_starts: np.ndarray, kind: type) -> tuple:
    """Each row's ``kind`` tuples ``(example, piece, offset, column, length)`` of a
    plan (``pieces [PLAN_FIELDS, P]``, ``row_starts [R + 1]``, int64): built in C
    (``plan_segments`` of ``kernels.c``); ``ValueError`` for arrays of another kind
    or row starts outside the plan."""
    return compiled_module().plan_segments(pieces, row_starts, kind)


@functools.cache
def compiled_module():
    """The compiled kernels as a Python module (for its C-API functions)."""
    compiled_library()  # built and of this layout, or a clear ImportError
    return importlib.import_module("exactstep.rows._kernels")


def host_tensors(tensors, dtypes) -> bool:
    """Whether each of ``tensors`` is a contiguous CPU tensor of its dtype in
    ``dtypes`` (a tuple of accepted dtypes per tensor), all of one size."""
    size = tensors[0].numel()
    return all(t.is_cpu and t.dtype in accepted and t.is_contiguous() and t.numel() == size
               for t, accepted in zip(tensors, dtypes, strict=True))


def screen(input_ids, labels, segment_ids, seq_len: int, vocab_size: int,
           ignore_boundary: bool, next_token: bool) -> bool:
    """``rows.invariants.is_clean`` over contiguous host tensors (int64 ids and
    labels, int32 or int64 segment ids) of one shape ``[B, T]``."""
    if not host_tensors((input_ids, labels, segment_ids), SCREENED):
        raise ValueError("screen needs contiguous host tensors of one size: int64 ids and "
                         "labels and int32/int64 segment ids")
    return bool(compiled_library().screen(input_ids.data_ptr(), labels.data_ptr(),
                                 segment_ids.data_ptr(), segment_ids.element_size(),
                                 input_ids.numel(), seq_len, vocab_size, ignore_boundary,
                                 next_token))


def count_supervised(labels) -> int:
    """How many of the contiguous host int64 tensor ``labels`` are not ``IGNORE``."""
    if not host_tensors((labels,), ((torch.int64,),)):
        raise ValueError("count_supervised needs a contiguous host int64 tensor")
    return int(compiled_library().count_supervised(labels.data_ptr(), labels.numel()))


SCREENED = ((torch.int64,), (torch.int64,), (torch.int32, torch.int64))  # screen's dtypes
