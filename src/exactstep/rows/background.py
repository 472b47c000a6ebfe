"""Background loading (P3): the next microbatches are packed and compiled while the
current window trains, with the same batches and the same resume state as without.

``BackgroundStream(stream, depth)`` runs ``stream.next_batch()`` on one worker thread
that keeps up to ``depth`` compiled batches in a bounded queue. The planner's buffer,
the causal fill and the R7 screen are C kernels called without the GIL
(``rows.kernels``), and the training step spends most of its time inside torch
operators that release it, so the two overlap; the Python around the kernels still
takes the GIL from the step for a few tens of microseconds per batch.

Invariants:

- The consumer sees exactly the batches the wrapped stream would give, in order:
  the worker is the only caller of the stream after the first batch is requested.
- ``state_dict()`` is the wrapped stream's state *after the last batch consumed*,
  never after the ones prefetched: the worker snapshots the state right after
  compiling each batch (``RowStream.snapshot``: arrays copied, the state dict built
  only when asked) and the snapshot travels with it through the queue. A
  checkpoint taken between windows therefore resumes exactly where the consumer
  stood (S2, S5), whatever ``depth`` was.
- ``load_state_dict`` is allowed only before the first batch is requested (a resume
  loads the cursor before training starts).
- ``report()`` (R4) stops the worker and reports from the consumed state, so
  ``data_report.json`` is the same with and without background loading.
- An error raised while packing or compiling (an R7 refusal, a data error) is raised
  to the consumer at the batch where it happened, with its own type and message.
- ``close()`` stops the worker; the thread is a daemon, so an interrupted run exits.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from exactstep.rows.batch import Batch
from exactstep.rows.stream import BatchSource, RowStream, StreamSnapshot

_END = object()


class BackgroundStream(BatchSource):
    """``stream`` with its next batches prepared on a worker thread (see module doc)."""

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
        """The next batch (prepared ahead), or ``None`` at the end of a finite stream."""
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
        """The wrapped stream's state after the last consumed batch (S2)."""
        if self._consumed is not None:
            return self._consumed.state_dict()
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self._worker is not None:
            raise RuntimeError("load_state_dict after background loading started; load the "
                               "cursor before the first batch")
        self.stream.load_state_dict(state)

    def close(self) -> None:
        """Stop the worker (idempotent); prepared batches are dropped."""
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=5.0)

    def report(self) -> dict:
        """The data report (R4) of what was consumed, as without background loading."""
        self.close()
        if self._consumed is not None:
            self.stream.load_state_dict(self._consumed.state_dict())
        return self.stream.report()
