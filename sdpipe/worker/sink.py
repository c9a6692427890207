"""A worker's event records, sent to the driver in batches through the Dask event log."""

from __future__ import annotations

import threading
import time

from sdpipe.wire import events

__all__ = ["EventSink"]


class EventSink:
    """Buffers event records and ships them to the driver in batches.

    Batches (every ``interval`` seconds, or ``max_buffer`` records) go through the Dask worker's event log
    (``log_event``), which the driver subscribes to; the worker never waits for the driver.  A quarter of a second
    is the dashboard's own redraw interval; each batch costs the scheduler and the driver a message.  A batch
    travels as one msgpack blob (:func:`sdpipe.wire.events.pack`): Dask checks and serializes a message's every
    value, which for a batch of records costs more than packing them in one go, and the scheduler forwards the
    blob without unpacking it.
    """

    def __init__(self, topic: str, rank: int, interval: float = 0.25, max_buffer: int = 500):
        from distributed import get_worker

        self._worker = get_worker()
        self.topic, self.rank = topic, rank
        self.interval, self.max_buffer = interval, max_buffer
        self.buffer: list = []
        self._lock = threading.Lock()  # policies' server threads add records too
        self.sent = 0
        self.batches = 0
        self._last = time.monotonic()

    def add(self, record: dict) -> None:
        with self._lock:
            self.buffer.append(record)
            due = len(self.buffer) >= self.max_buffer or time.monotonic() - self._last >= self.interval
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            self._last = time.monotonic()
            if not self.buffer:
                return
            batch, self.buffer = self.buffer, []
            seq = self.batches
            self.batches += 1
            self.sent += len(batch)
        self._worker.log_event(self.topic, {"rank": self.rank, "seq": seq, "events": events.pack(batch)})
