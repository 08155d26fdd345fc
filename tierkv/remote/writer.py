"""Write-through to the remote tier on a background thread, through a queue bounded in items and bytes.

The decode and prefill paths only :meth:`WriteBehind.offer` a block: an append to a deque under a lock,
never a network call. When the queue is full (the server is slower than the blocks arrive, or down) the
block is dropped and counted: the remote tier is a cache, and a missing block is recomputed by whoever
needs it. The queue's bytes are host memory counted in no tier budget, so they are bounded by
``max_bytes`` (``DEFAULT_QUEUE_BYTES``, 64 MiB).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

DEFAULT_QUEUE_BYTES = 64 << 20
DEFAULT_QUEUE_ITEMS = 1024
BATCH_BYTES = 16 << 20  # one pipeline carries at most this much (or one larger block)
BATCH_ITEMS = 32

Item = tuple[str, bytes | memoryview | None]  # (key, payload); payload None deletes the key (a corrupt value)


class WriteBehind:
    """A bounded queue of writes drained in batches by one daemon thread calling ``write(batch)``.

    ``write`` must not raise for a remote failure (:class:`~tierkv.remote.connection.RemoteConnection.run`
    turns those into counts); anything it raises is counted by ``on_error`` and the thread goes on.
    """

    def __init__(self, write: Callable[[list[Item]], None], on_drop: Callable[[int], None],
                 on_error: Callable[[BaseException], None], max_items: int = DEFAULT_QUEUE_ITEMS,
                 max_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self._write = write
        self._on_drop = on_drop
        self._on_error = on_error
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._queue: deque[Item] = deque()
        self._bytes = 0
        self._busy = 0  # items taken by the thread and not yet written
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tierkv-remote-writer", daemon=True)
        self._thread.start()

    def offer(self, key: str, payload: bytes | memoryview | None) -> bool:
        """Queue a write (``payload`` None: a delete); False, counted as dropped, when the queue is full."""
        size = len(payload) if payload is not None else 0
        with self._cond:
            full = len(self._queue) >= self.max_items or (self._queue and self._bytes + size > self.max_bytes)
            if self._closed or full:
                drop = True
            else:
                self._queue.append((key, payload))
                self._bytes += size
                self._cond.notify_all()
                drop = False
        if drop:
            self._on_drop(size)
        return not drop

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + self._busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (True), or ``timeout`` seconds passed (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` s; the rest is dropped), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left, self._queue = self._queue, deque()
            self._bytes = 0
            self._cond.notify_all()
        for _, payload in left:
            self._on_drop(len(payload) if payload is not None else 0)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _take(self) -> list[Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch, size = [], 0
            while self._queue and len(batch) < BATCH_ITEMS:
                key, payload = self._queue[0]
                n = len(payload) if payload is not None else 0
                if batch and size + n > BATCH_BYTES:
                    break
                self._queue.popleft()
                batch.append((key, payload))
                size += n
            self._bytes -= size
            self._busy = len(batch)
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._write(batch)
            except Exception as exc:  # a bug in a write must not kill the thread that every later write needs
                self._on_error(exc)
            finally:
                with self._cond:
                    self._busy = 0
                    self._cond.notify_all()
