"""Background loading on a worker thread: batches packed ahead while a window trains (P3).

``BackgroundStream(stream, depth)`` wraps a ``RowStream`` and gives exactly its
batches, in order; its ``state_dict()`` is the state after the last batch consumed,
never after those prefetched (S2, S5), and ``report()`` is the same as in line (R4).
Design and derivations: docs/design/rows.md#rowsbackgroundpy (P3, R4, R7, S2, S5).
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from exactstep.rows.batch import Batch
from exactstep.rows.stream import BatchSource, RowStream, StreamSnapshot

_END = object()


class BackgroundStream(BatchSource):
    """``stream`` with up to ``depth`` next batches prepared on a worker thread (P3).

    The consumer gets exactly the batches ``stream`` would give, in order; the worker
    is the stream's only caller once the first batch is requested. Invariants and
    overlap: docs/design/rows.md#rowsbackgroundpy.
    """

    def __init__(self, stream: RowStream, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1; got {depth}")
        self.stream = stream
        self.depth = depth
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._consumed: StreamSnapshot | None = None
        self._finished = False

    # -- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.stream.next_batch()
                item = _END if batch is None else (batch, self.stream.snapshot())
                if not self._put(item) or item is _END:
                    return
        except BaseException as exc:  # delivered to the consumer, raised there
            self._put(exc)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _start(self) -> None:
        if self._worker is None:
            self._consumed = self.stream.snapshot()  # nothing consumed yet
            self._worker = threading.Thread(target=self._run, name="exactstep-rows",
                                            daemon=True)
            self._worker.start()

    # -- the stream interface -----------------------------------------------------------

    def next_batch(self) -> Batch | None:
        """The next batch (prepared ahead), or ``None`` at the end of a finite stream.
        An error raised while packing or compiling (an R7 refusal, a data error) is
        raised here, at the batch where it happened, with its own type and message."""
        if self._finished:
            return None
        self._start()
        item = self._queue.get()
        if item is _END:
            self._finished = True
            return None
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        batch, self._consumed = item
        return batch

    def state_dict(self) -> dict:
        """The wrapped stream's state after the last consumed batch, never after the
        prefetched ones, whatever ``depth`` is (S2, S5)."""
        if self._consumed is not None:
            return self._consumed.state_dict()
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load the cursor; only before the first batch is requested (``RuntimeError``
        after that)."""
        if self._worker is not None:
            raise RuntimeError("load_state_dict after background loading started; load the "
                               "cursor before the first batch")
        self.stream.load_state_dict(state)

    def close(self) -> None:
        """Stop the worker (idempotent); prepared batches are dropped. The thread is a
        daemon, so an interrupted run exits even without this call."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=5.0)

    def report(self) -> dict:
        """The data report (R4) of what was consumed, as without background loading
        (the worker is stopped first)."""
        self.close()
        if self._consumed is not None:
            self.stream.load_state_dict(self._consumed.state_dict())
        return self.stream.report()
