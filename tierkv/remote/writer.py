"""Write-through to the remote tier on a background thread, through a queue bounded in items and bytes.

Callers only :meth:`WriteBehind.offer` a block: an append to a deque under a lock, never a network call.
When the queue is full:

- an offer with ``wait=True`` (the persistence thread's: a background thread that can afford it) waits for
  room — *backpressure* — as long as the writer keeps sending: it gives up, and drops the block, only when
  no batch was sent for ``wait_s`` seconds (the server is slower than one batch, at most ``BATCH_BYTES``,
  per ``wait_s``: 16 MiB per 10 s by default) or when the server is down (then it does not even queue);
- any other offer (reads deleting a corrupt value, local blocks pushed on a read) drops at once.

A drop is counted and warned (``on_drop``): the remote tier is a cache, and a missing block is recomputed by
whoever needs it. The queue's bytes are host memory counted in no tier budget, so they are bounded by
``max_bytes`` (``DEFAULT_QUEUE_BYTES``, 64 MiB; the ``remote_queue`` setting).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

DEFAULT_QUEUE_BYTES = 64 << 20
DEFAULT_QUEUE_ITEMS = 1024
DEFAULT_WAIT_S = 10.0  # an offer that may wait gives up after this long without a batch sent
BATCH_BYTES = 16 << 20  # one pipeline carries at most this much (or one larger block)
BATCH_ITEMS = 32

Item = tuple[str, bytes | bytearray | memoryview | None]  # (key, payload); a None payload deletes the key


class WriteBehind:
    """A bounded queue of writes drained in batches by one daemon thread calling ``write(batch)``.

    ``write`` must not raise for a remote failure (:class:`~tierkv.remote.connection.RemoteConnection.run`
    turns those into counts); anything it raises is counted by ``on_error`` and the thread goes on.
    ``on_drop(size, reason)`` is told of each dropped write: reason ``"full"``, ``"slow"`` (waited
    ``wait_s`` with no batch sent), ``"down"`` (``is_down()`` was true) or ``"closed"``.
    """

    def __init__(self, write: Callable[[list[Item]], None], on_drop: Callable[[int, str], None],
                 on_error: Callable[[BaseException], None], max_items: int = DEFAULT_QUEUE_ITEMS,
                 max_bytes: int = DEFAULT_QUEUE_BYTES, wait_s: float = DEFAULT_WAIT_S,
                 is_down: Callable[[], bool] = lambda: False) -> None:
        self._write = write
        self._on_drop = on_drop
        self._on_error = on_error
        self._is_down = is_down
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.wait_s = wait_s
        self._queue: deque[Item] = deque()
        self._bytes = 0
        self._busy = 0  # items taken by the thread and not yet written
        self._closed = False
        self._progress = time.monotonic()  # the last batch sent, or work arriving at an idle writer
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tierkv-remote-writer", daemon=True)
        self._thread.start()

    def _full(self, size: int) -> bool:
        return len(self._queue) >= self.max_items or bool(self._queue) and self._bytes + size > self.max_bytes

    def offer(self, key: str, payload: bytes | bytearray | memoryview | None, wait: bool = False) -> bool:
        """Queue a write (``payload`` None: a delete); False, counted as dropped, when it was not queued.
        With ``wait``, a full queue is waited on while the writer makes progress (the module doc)."""
        size = len(payload) if payload is not None else 0
        reason = ""
        with self._cond:
            while not self._closed:
                if wait and self._is_down():
                    reason = "down"
                    break
                if not self._full(size):
                    break
                left = self._progress + self.wait_s - time.monotonic() if wait else 0.0
                if left <= 0:
                    reason = "slow" if wait else "full"
                    break
                self._cond.wait(left)
            if self._closed:
                reason = "closed"
            if not reason:
                if not self._queue and not self._busy:
                    self._progress = time.monotonic()
                self._queue.append((key, payload))
                self._bytes += size
                self._cond.notify_all()
        if reason:
            self._on_drop(size, reason)
        return not reason
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
        """Send what is queued, drop the rest, and stop the thread: within ``timeout`` s in all (a write still in
        flight then is left to its daemon thread and its socket timeout)."""
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        with self._cond:
            self._closed = True
            left, self._queue = self._queue, deque()
            self._bytes = 0
            self._cond.notify_all()
        for _, payload in left:
            self._on_drop(len(payload) if payload is not None else 0, "closed")
        if self._thread is not threading.current_thread():
            self._thread.join(max(0.0, deadline - time.monotonic()))

    def _take(self) -> list[Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            batch: list[Item] = []
            size = 0
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
                    self._progress = time.monotonic()
                    self._cond.notify_all()
