"""Background loading in a loader process: batches packed ahead in a child (P3).

``LoaderProcess(stream, depth)`` has the interface and the invariants of the worker
thread (``rows.background``) without competing for the step's GIL: the same batches,
the state after the last one consumed (S2, S5), errors raised at their batch. The
child is spawned, so a training script needs ``if __name__ == "__main__":``.
Design and derivations: docs/design/rows.md#rowsloader_processpy (P3, R4, R7, S2, S5).
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import select
import signal
import sys
import threading
import traceback
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch

from exactstep.errors import DataError, ExactstepError
from exactstep.rows import kernels
from exactstep.rows.batch import Batch, Segment, SourceSide
from exactstep.rows.stream import BatchSource, RowStream
from exactstep.state import denormals

POLL_S = 0.05  # how often a waiting side looks whether the other one is still there
JOIN_S = 5.0  # how long close() waits for the child to stop by itself
PROTOCOL = pickle.HIGHEST_PROTOCOL


class LoaderProcess(BatchSource):
    """``stream`` with up to ``depth`` next batches prepared in a child process (P3).

    The interface and invariants of ``rows.background.BackgroundStream``: the same
    batches in order, the state after the last one consumed. The child is started
    with ``spawn`` (train under ``if __name__ == "__main__":``), ignores SIGINT and
    SIGTERM (the parent's stop request finishes the window) and exits when its
    parent dies. Design: docs/design/rows.md#rowsloader_processpy.
    """

    def __init__(self, stream: RowStream, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1; got {depth}")
        self.stream = stream
        self.depth = depth
        self.process: Any = None  # the child (multiprocessing's SpawnProcess) once started
        self._channel: Channel | None = None
        self._consumed_state: dict | None = None
        self._consumed_blob: bytes | None = None  # the child's pickled state, decoded lazily
        self._consumed = 0
        self._finished = False

    # -- the child ----------------------------------------------------------------------

    def _start(self) -> None:
        if self.process is not None:
            return
        self._consumed_state = self.stream.state_dict()  # nothing consumed yet
        ctx = mp.get_context("spawn")
        channel = Channel(ctx, self.depth, slot_bytes(self.stream))
        self.process = ctx.Process(target=serve, name="exactstep-loader", daemon=True,
                                   args=(self.stream, channel, denormals.flushed_here()))
        self.process.start()
        LIVE.add(self)
        channel.writer.close()  # the child's end: its death is then an end of file here
        self._channel = channel

    def _receive(self) -> tuple:
        reader, ready = self._channel.reader, self._channel.ready
        try:
            while not ready(POLL_S):
                if not self.process.is_alive() and not ready(0):
                    raise EOFError
            message = pickle.loads(reader.recv_bytes())
        except (EOFError, OSError):
            self.process.join(timeout=JOIN_S)
            raise DataError(
                f"the loader process ended (exit code {self.process.exitcode}) before "
                f"sending batch {self._consumed + 1}; if it was killed (out of memory?) "
                "free memory and resume; a script that trains must do so under 'if "
                "__name__ == \"__main__\":' (the loader process imports it); or set "
                "train.loader = \"thread\"") from None
        self._channel.credits.release()  # room for one more batch ahead
        return message

    # -- the stream interface -----------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """The next batch (prepared ahead), or ``None`` at the end of a finite stream.
        An error raised while packing or compiling is raised here with its own type
        and message; a child that died without a word is a ``DataError``."""
        if self._finished:
            return None
        self._start()
        kind, payload, state = self._receive()
        if kind == "end":
            self._finished = True
            return None
        if kind == "error":
            self._finished = True
            raise payload
        k, wire = payload
        slot = None if k is None else self._channel.slot(k)
        batch = from_wire(wire, slot)
        self._consumed_blob, self._consumed_state = state_bytes(state, slot), None
        self._consumed += 1
        return batch

    def state_dict(self) -> dict:
        """The stream's state after the last consumed batch (S2)."""
        if self._consumed_blob is not None:
            self._consumed_state = pickle.loads(self._consumed_blob).state_dict()
            self._consumed_blob = None
        if self._consumed_state is not None:
            return self._consumed_state
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load the cursor; only before the first batch is requested (``RuntimeError``
        after that)."""
        if self.process is not None:
            raise RuntimeError("load_state_dict after background loading started; load the "
                               "cursor before the first batch")
        self.stream.load_state_dict(state)

    def close(self) -> None:
        """Stop and reap the child (idempotent); prepared batches are dropped. A flag
        and a closed pipe, then join, then SIGKILL; one left open is closed at exit."""
        channel, proc = self._channel, self.process
        if channel is None:
            return
        self._channel = None
        LIVE.discard(self)
        channel.stop.value = 1
        channel.reader.close()  # a child blocked in a send gets a broken pipe
        proc.join(timeout=JOIN_S)
        if proc.exitcode is None:
            proc.kill()  # it ignores SIGTERM
            proc.join()

    def report(self) -> dict:
        """The data report (R4) of what was consumed, as without background loading."""
        self.close()
        if self.process is not None:
            self.stream.load_state_dict(self.state_dict())
        return self.stream.report()


LIVE: weakref.WeakSet[LoaderProcess] = weakref.WeakSet()  # started, not closed


@atexit.register
def close_live() -> None:
    """Close every loader left open at interpreter exit. Registered after
    ``multiprocessing``'s own exit hook, so it runs first: that hook would SIGTERM
    the child, which ignores it, and wait for it for ever."""
    for loader in list(LIVE):
        loader.close()


class Channel:
    """What the two processes share: a one-way pipe of messages (child to parent),
    ``credits`` (a semaphore of ``depth``: the child takes one per batch it sends, the
    parent gives it back per batch received, so at most ``depth`` wait), a ``stop``
    flag and the batch slots (``Slots``). Nothing here is a lock the child could die
    holding: the flag is a shared byte without one (a ``multiprocessing.Event`` takes
    a shared lock to read it, and a child killed inside would hang the parent)."""

    def __init__(self, ctx: Any, depth: int, size: int) -> None:
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.credits = ctx.Semaphore(depth)
        self.stop = ctx.RawValue("b", 0)
        self.slots = Slots(ctx, depth + 2, size)
        self._memory: np.ndarray | None = None
        self._poller: Any = None  # select.poll of the reader, made at first use

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_memory", "_poller")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _memory=None, _poller=None)

    def ready(self, timeout: float) -> bool:
        """Whether a message (or the end of the pipe) is there to read, waiting up to
        ``timeout`` seconds: one ``poll`` call (``Connection.poll`` builds a selector
        in Python on every call, tens of microseconds a batch)."""
        if not hasattr(select, "poll"):  # not a POSIX system
            return self.reader.poll(timeout)
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.reader.fileno(), select.POLLIN)
        return bool(self._poller.poll(timeout * 1000))

    def slot(self, k: int) -> np.ndarray:
        """Slot ``k`` as bytes (a view of the shared mapping)."""
        if self._memory is None:
            self._memory = self.slots.view()
        size = self.slots.size
        return self._memory[k * size: (k + 1) * size]


# --------------------------------------------------------------------------- the wire


class Wire(NamedTuple):
    """A ``Batch`` or ``SourceSide`` in transit: its class and its fields, each tensor
    a ``Slab`` of the shared slot or, when the batch did not fit, a NumPy array, and
    its ``segments`` a ``Rows`` of the slot; ``extent`` is how many bytes of the slot
    it uses (0 without one)."""

    cls: type
    fields: dict[str, Any]
    extent: int = 0


class Slab(NamedTuple):
    """An array written at ``offset`` of a slot: its dtype (``numpy`` string) and shape."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


class Rows(NamedTuple):
    """Host row addresses (``segments``) in transit: the rows' ``Segment``s laid out as
    a plan (``rows.kernels``: ``pieces [PLAN_FIELDS, P]`` and ``row_starts [R + 1]``,
    two ``Slab``s), rebuilt in C by ``kernels.plan_segments``: a message holds no
    Python object per segment."""

    pieces: Slab
    row_starts: Slab


class Slots:
    """``count`` slots of ``size`` bytes in one shared, anonymous mapping (a
    ``multiprocessing`` ``RawArray``: its file is unlinked at once and reaches the child
    as a descriptor, so nothing outlives the two processes). The child writes batch
    ``n`` into slot ``n % count`` after taking a credit; the parent copies it out
    before it takes the next message, so with ``count = depth + 2`` a slot is never
    written again before the batch in it was copied (at most ``depth`` batches hold a
    credit, the one being written included, and one more may be being copied)."""

    def __init__(self, ctx: Any, count: int, size: int) -> None:
        self.count, self.size = count, size
        self.raw = ctx.RawArray("b", count * size)

    def view(self) -> np.ndarray:
        return np.frombuffer(self.raw, dtype=np.uint8)


def slot_bytes(stream: RowStream) -> int:
    """Room for one batch of ``stream``: 48 bytes a cell of ``rows x seq_len`` (the
    [B, T] tensors of every family, an encoder side of up to T columns included) and
    64 KiB for the small ones, the row addresses and the stream's state after the
    batch (about 48 bytes a pending piece); a larger batch crosses pickled instead,
    and a larger state in the message (slower, same)."""
    cfg = stream.cfg
    return 48 * cfg.rows * cfg.seq_len + (64 << 10) + 48 * cfg.buffer


def to_wire(item: Batch | SourceSide, slot: np.ndarray | None = None,
            used: list[int] | None = None) -> Wire:
    """``item`` as its class and its fields, every tensor written into ``slot`` (from
    ``used[0]`` on, 64-byte aligned) as a ``Slab`` and the ``segments`` as ``Rows``,
    or, without a slot, tensors as NumPy arrays and the rest as it is; other host
    data (``causal``, ``meta``) is kept as it is. ``OverflowError`` if it does not
    fit the slot."""
    used = [0] if used is None else used
    fields = {}
    for f in dataclasses.fields(item):
        value = getattr(item, f.name)
        if isinstance(value, torch.Tensor):
            array = value.detach().cpu().numpy()
            value = array if slot is None else write_slab(slot, used, array)
        elif isinstance(value, SourceSide):
            value = to_wire(value, slot, used)
        elif f.name == "segments" and slot is not None:
            value = write_rows(slot, used, value)
        fields[f.name] = value
    return Wire(type(item), fields, used[0] if slot is not None else 0)


def write_slab(slot: np.ndarray, used: list[int], array: np.ndarray) -> Slab:
    """Copy ``array`` into ``slot`` at ``used[0]``; ``OverflowError`` if it does not fit."""
    offset = -(-used[0] // 64) * 64
    if offset + array.nbytes > len(slot):
        raise OverflowError("the batch does not fit its slot")
    np.copyto(np.ndarray(array.shape, array.dtype, slot.data, offset), array, casting="no")
    used[0] = offset + array.nbytes
    return Slab(offset, array.dtype.str, tuple(array.shape))


def write_rows(slot: np.ndarray, used: list[int], segments) -> Rows:
    """``segments`` (rows of ``Segment``) into ``slot`` as a plan (``Rows``)."""
    every = [s for row in segments for s in row]
    pieces = np.zeros((kernels.PLAN_FIELDS, len(every)), dtype=np.int64)
    if every:
        example, piece, offset, start, length = zip(*every, strict=True)
        pieces[[kernels.EXAMPLE, kernels.PIECE, kernels.OFFSET, kernels.COLUMN,
                kernels.LENGTH]] = (example, piece, offset, start, length)
    starts = np.cumsum([0] + [len(row) for row in segments], dtype=np.int64)
    return Rows(write_slab(slot, used, pieces), write_slab(slot, used, starts))


def from_wire(wire: Wire, slot: np.ndarray | None = None) -> Any:
    """The ``Batch`` (or ``SourceSide``) that ``to_wire`` took apart, on torch tensors
    of its own memory: the bytes it uses of ``slot`` are copied out once, and each
    tensor is a view of that copy."""
    return rebuild(wire, None if slot is None else slot[: wire.extent].copy())


def rebuild(wire: Wire, region: np.ndarray | None) -> Any:
    """``from_wire`` over ``region``, the copy of the slot's bytes."""
    fields = dict(wire.fields)
    for name, value in fields.items():
        if isinstance(value, Slab):
            fields[name] = torch.from_numpy(slab_view(region, value))
        elif isinstance(value, Rows):
            fields[name] = kernels.plan_segments(slab_view(region, value.pieces),
                                                 slab_view(region, value.row_starts),
                                                 Segment)
        elif isinstance(value, np.ndarray):
            fields[name] = torch.from_numpy(value)
        elif isinstance(value, Wire):
            fields[name] = rebuild(value, region)
    return wire.cls(**fields)


def state_bytes(state: bytes | Slab, slot: np.ndarray | None) -> bytes:
    """A message's pickled state: itself, or copied out of ``slot`` (a ``Slab``)."""
    if isinstance(state, Slab):
        return slot[state.offset: state.offset + state.shape[0]].tobytes()
    return state


def slab_view(region: np.ndarray, slab: Slab) -> np.ndarray:
    """The array ``slab`` describes, a view of ``region``."""
    return np.ndarray(slab.shape, np.dtype(slab.dtype), region.data, slab.offset)


# --------------------------------------------------------------------------- the child


def serve(stream: RowStream, channel: Channel, flush_denormal: bool) -> None:
    """The child: send ``("batch", (slot, wire), state)`` per batch (``slot`` ``None``
    when it crossed pickled; ``state`` pickled, decoded only if the parent asks, and
    in the slot as a ``Slab`` where it fits), then
    ``("end", None, None)`` or ``("error", exception, None)``, until ``stop`` is set,
    the parent stops reading or the parent dies. It computes under the parent's
    denormal setting (``flush_denormal``, S9)."""
    for number in (signal.SIGINT, signal.SIGTERM):  # the parent's to handle (StopRequest)
        signal.signal(number, signal.SIG_IGN)
    torch.set_num_threads(1)  # compiling builds small tensors; leave the cores to training
    denormals.set_flush_denormal(flush_denormal)
    yield_on_wakeup()
    watch_parent()
    channel.reader.close()  # the parent's end
    sent = 0
    try:
        while wait_credit(channel):
            try:
                message = next_message(stream, channel, sent)
            except BaseException as exc:  # delivered to the consumer, raised there
                message = ("error", sendable(exc), None)
            send(channel, message)
            if message[0] != "batch":
                break
            sent += 1
    except OSError:  # the parent closed its end (close()) or died
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: nothing here needs one


def next_message(stream: RowStream, channel: Channel, sent: int) -> tuple:
    """The message for the stream's next batch: written into slot ``sent % count``
    (pickled whole if it does not fit), with the state right after it (in the slot
    after the batch where there is room, else in the message)."""
    batch = stream.next_batch()
    if batch is None:
        return ("end", None, None)
    k, slot, used = sent % channel.slots.count, None, [0]
    try:
        slot = channel.slot(k)
        payload = (k, to_wire(batch, slot, used))
    except OverflowError:
        payload = (None, to_wire(batch))
    state = pickle.dumps(stream.snapshot(), PROTOCOL)
    if payload[0] is not None:
        try:
            state = write_slab(slot, used, np.frombuffer(state, dtype=np.uint8))
        except OverflowError:
            pass  # the state crosses in the message
    return ("batch", payload, state)


def wait_credit(channel: Channel) -> bool:
    """Take a credit (room for one more batch ahead); ``False`` once ``stop`` is set."""
    while not channel.stop.value:
        if channel.credits.acquire(timeout=POLL_S):
            return True
    return False


def send(channel: Channel, message: tuple) -> None:
    channel.writer.send_bytes(pickle.dumps(message, PROTOCOL))


def sendable(exc: BaseException) -> BaseException:
    """``exc`` itself when it survives pickling, else a ``RuntimeError`` with its type
    and message; a bug (not an ``ExactstepError``) carries the child's traceback as a
    note."""
    if not isinstance(exc, ExactstepError):
        exc.add_note("in the loader process:\n" + "".join(traceback.format_exception(exc)))
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__} in the loader process: {exc}")


def yield_on_wakeup() -> None:
    """Schedule this process as a batch job (Linux ``SCHED_BATCH``: the same share of
    the CPU, but a wakeup does not preempt a running task), so that on a busy machine
    the child, woken when the parent takes a batch, does not take the parent's core
    there and then; measured (``bench loader``) this cuts the parent's wait per batch
    about fourfold when every core is busy. Elsewhere nothing changes."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is not None:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except OSError:
            pass


def watch_parent() -> None:
    """End this process as soon as its parent dies (no orphan loader)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def wait() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=wait, name="exactstep-loader-parent", daemon=True).start()
