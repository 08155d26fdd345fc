"""The portable engine: ``os.preadv`` / ``os.pwritev`` on a per-file thread pool.

Both calls release the GIL for the duration of the system call, so Python threads give real queue
depth: with 16 workers, 16 requests are in the kernel at once. A batch is cut into pieces of at most
:func:`~tierkv.io.base.chunk_bytes`; instead of one future per piece (tens of microseconds of executor
overhead each, which adds up for a step of a thousand blocks), the batch starts ``queue depth`` runners
that pull pieces from a shared counter until none are left. A batch is finished when its last piece is: where the
process cannot start another thread (a thread, process or address-space limit), the calling thread runs the
remaining pieces itself and the file keeps the threads it has (a warning says so), and a runner whose thread
started late finds the counter drained.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tierkv import forks
from tierkv.io.base import (
    CompletedHandle,
    DiskFile,
    IOHandle,
    Request,
    check_requests,
    chunk_bytes,
    eof_error,
    open_fd,
    queue_depth,
    split,
)

log = logging.getLogger("tierkv")


class _Batch(IOHandle):
    """Runners of one batch, the errors they met (keyed by request index), and the event of its last piece."""

    def __init__(self, futures: list[cf.Future[None]], errors: dict[int, OSError], landed: threading.Event) -> None:
        self._futures = futures
        self._errors = errors
        self._landed = landed

    def wait(self) -> None:
        cf.wait(self._futures)
        for future in self._futures:
            future.result()  # a non-OSError bug in a runner surfaces here rather than vanishing
        self._landed.wait()  # (a piece taken by a runner whose thread started late)
        if self._errors:
            raise self._errors[min(self._errors)]

    def done(self) -> bool:
        return self._landed.is_set() and all(future.done() for future in self._futures)


class PosixFile(DiskFile):
    """A file read and written with ``preadv``/``pwritev`` from a pool of ``queue_depth()`` threads."""

    engine_name = "posix"

    def __init__(self, path: str | os.PathLike[str], direct: bool | None) -> None:
        self.path = os.fspath(path)
        self.fd, self.direct, self.direct_refused = open_fd(path, direct)
        self._depth = queue_depth()
        self._chunk = chunk_bytes()
        self._pool: cf.ThreadPoolExecutor | None = cf.ThreadPoolExecutor(
            max_workers=self._depth, thread_name_prefix="tierkv-posix-io"
        )
        # a file dropped without close() (or alive at exit) still stops its threads and closes its descriptor
        self._finalizer = forks.finalize(self, _release, self._pool, self.fd)

    def submit_reads(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(check_requests(requests, direct=self.direct, writable=True), self._read_piece)

    def submit_writes(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(check_requests(requests, direct=self.direct, writable=False), self._write_piece)

    def _submit(self, requests: list[Request], op: Any) -> IOHandle:
        pool = self._pool  # read once: close() on another thread sets it to None
        if pool is None:
            raise ValueError(f"I/O on closed {self!r}.")
        if not requests:
            return CompletedHandle()
        pieces = split(requests, self._chunk)
        counter, finished = itertools.count(), itertools.count(1)  # next() is atomic under the GIL: lock-free
        errors: dict[int, OSError] = {}
        landed, closed = threading.Event(), threading.Event()

        def runner() -> None:
            while not closed.is_set() and (i := next(counter)) < len(pieces):
                index, offset, view = pieces[i]
                try:
                    if index not in errors:  # (a request that failed already: its other pieces need not run)
                        op(offset, view)
                except OSError as exc:
                    errors.setdefault(index, exc)
                finally:
                    if next(finished) == len(pieces):
                        landed.set()

        futures: list[cf.Future] = []
        try:
            for _ in range(min(self._depth, len(pieces))):
                futures.append(pool.submit(runner))
        except RuntimeError as exc:
            if self._pool is None:  # shut down meanwhile by close() on another thread: what was queued runs first
                closed.set()
                cf.wait(futures)
                raise ValueError(f"I/O on closed {self!r}.") from None
            self._fewer_threads(len(futures), exc)
            runner()  # no thread for the rest: this one runs it (a runner queued without a thread finds none left)
        return _Batch(futures, errors, landed)

    def _fewer_threads(self, started: int, exc: RuntimeError) -> None:
        """A batch could start only ``started`` runners (``exc``: no new thread): later batches start no more than
        the threads this file has."""
        depth, self._depth = self._depth, max(1, started)
        if depth > self._depth:
            log.warning("tierkv: the posix disk engine could not start another I/O thread for %s (%s: a thread, "
                        "process or memory limit); it goes on with %d at a time (TIERKV_IO_QUEUE_DEPTH sets how many "
                        "it starts).", self.path, exc, self._depth)

    def _read_piece(self, offset: int, view: np.ndarray) -> None:
        done, nbytes = 0, view.nbytes
        while done < nbytes:
            got = os.preadv(self.fd, [view[done:].data], offset + done)
            if got == 0:
                raise eof_error(self.path, offset, nbytes, done)
            done += got

    def _write_piece(self, offset: int, view: np.ndarray) -> None:
        done, nbytes = 0, view.nbytes
        while done < nbytes:
            put = os.pwritev(self.fd, [view[done:].data], offset + done)
            if put == 0:  # the kernel wrote nothing without an error: report it rather than spin
                raise OSError(errno.EIO, f"pwritev wrote 0 of {nbytes - done} bytes at {offset}", self.path)
            done += put

    def close(self) -> None:
        self._pool = None
        self._finalizer()


def _release(pool: cf.ThreadPoolExecutor, fd: int) -> None:
    """Finish the queued requests, stop the threads, close the descriptor."""
    try:
        pool.shutdown(wait=True)
    except RuntimeError:  # collected on one of the pool's own threads, which cannot join itself
        pool.shutdown(wait=False)
    finally:
        os.close(fd)
