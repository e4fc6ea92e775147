"""``--enable-async-logging``: the root logger's records go through a bounded, lossy queue
that one thread drains into the handlers, so a slow log stream (a pipe nobody reads fast
enough, a full disk) never holds up a round. A full queue drops records and counts them.

The owner (a rank process, the server) flushes it explicitly when serving ends -- errors
included, and before it tells its launcher of a failure: returning from the loop does not
finalize Python, so an atexit hook alone would lose those records. The flush is bounded,
because the stream may be stalled for good.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

DEFAULT_CAPACITY = 10_000


class _LossyHandler(logging.Handler):
    def __init__(self, records: queue.Queue, owner: AsyncLogging) -> None:
        super().__init__()
        self.records = records
        self.owner = owner

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.msg = record.getMessage()  # format now: the args may change later
            record.args = None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
            self.records.put_nowait(record)
        except queue.Full:
            self.owner.dropped += 1


class AsyncLogging:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.records: queue.Queue = queue.Queue(maxsize=capacity)
        self.dropped = 0
        self._handlers: list[logging.Handler] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Move the root logger's handlers behind the queue."""
        root = logging.getLogger()
        self._handlers = list(root.handlers)
        for handler in self._handlers:
            root.removeHandler(handler)
        root.addHandler(_LossyHandler(self.records, self))
        self._thread = threading.Thread(target=self._drain, name="ts-async-log", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                record = self.records.get(timeout=0.1)
            except queue.Empty:
                continue
            self._write(record)

    def _write(self, record: logging.LogRecord) -> None:
        for handler in self._handlers:
            if record.levelno >= handler.level:
                try:
                    handler.handle(record)
                except Exception:
                    self.dropped += 1

    def shutdown(self, timeout: float = 2.0) -> None:
        """Write what is queued within ``timeout`` seconds, then give the handlers back."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._write(self.records.get_nowait())
            except queue.Empty:
                break
        root = logging.getLogger()
        for handler in list(root.handlers):
            if isinstance(handler, _LossyHandler):
                root.removeHandler(handler)
        for handler in self._handlers:
            root.addHandler(handler)
            handler.flush()
        if self.dropped:
            logging.getLogger(__name__).warning("async logging dropped %d records", self.dropped)
        self._thread = None
