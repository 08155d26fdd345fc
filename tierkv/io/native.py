"""The native engine: the C library of ``native/tierkv_io.c``, driven through ctypes.

Where the library comes from, in order (the choice is logged once on the ``tierkv`` logger):

1. *extension*: built with the package by ``setup.py`` as ``tierkv/io/_native*.so`` (an optional extension,
   so installing succeeds without a compiler). Used unless it was built from an older source than the
   checkout's (an editable install whose C file was edited since): the source's hash is compiled in.
2. *built on first use*, FlashInfer-style, from a source checkout (``native/`` beside the package): the
   system compiler (``$CC``, else ``cc``) writes it into the ``cache_dir`` setting (``$TIERKV_CACHE_DIR``,
   else ``$XDG_CACHE_HOME/tierkv``, else ``~/.cache/tierkv``) under a name that carries a hash of the
   source and flags, written aside and renamed into place so concurrent processes never load a half-written
   library.
3. otherwise the engine is unavailable, with the reason, and auto-selection uses posix.

The outcome, success or the reason of failure, is cached for the process (``functools.cache``): a missing
compiler costs one lookup, not one per opened file.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tierkv import cbuild, settings
from tierkv.errors import InvalidConfigError
from tierkv.io.base import (
    ArrayPlan,
    CompletedHandle,
    DiskFile,
    EngineUnavailableError,
    IOHandle,
    check_array_requests,
    check_requests,
    chunk_bytes,
    eof_error,
    fit_plan,
    open_fd,
    queue_depth,
)

logger = logging.getLogger("tierkv")

SOURCE = Path(__file__).resolve().parents[2] / "native" / "tierkv_io.c"
"""The C source in a source checkout (also an editable install); a wheel ships only the built extension."""
_EOF = -1  # TKV_EOF in the C source
_CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
_FIX = "Install a C compiler (e.g. `apt-get install gcc`) or set CC, or use TIERKV_DISK_ENGINE=posix."

_u64p = ctypes.POINTER(ctypes.c_uint64)


def source_digest() -> str | None:
    """sha256 of :data:`SOURCE` (16 hex digits, as ``setup.py`` compiles it in); None without the source."""
    return cbuild.source_digest(SOURCE)


def extension() -> Path | None:
    """The library the install built (``tierkv/io/_native<ABI suffix>``), if it did."""
    return cbuild.extension(Path(__file__).parent, "_native")


_built_from = functools.partial(cbuild.built_from, symbol="tkv_source_sha")
"""The source hash a loaded library's ``tkv_source_sha()`` returns ("" if it has none)."""


def _open_library() -> ctypes.CDLL:
    """Load the extension, else build on first use (module docstring); raise EngineUnavailableError."""
    return cbuild.open_library("native engine", SOURCE, source_digest(), extension(), _built_from, (_CFLAGS,), (),
                               _FIX, "Reinstall tierkv where a C compiler is available, or use "
                               "TIERKV_DISK_ENGINE=posix.")


@functools.cache
def _build() -> ctypes.CDLL | EngineUnavailableError:
    """Open the library once per process and declare its functions; return the error instead of raising so
    that the failure, too, is cached."""
    try:
        lib = _open_library()
    except EngineUnavailableError as exc:
        return exc
    lib.tkv_pool_new.restype = ctypes.c_void_p
    lib.tkv_pool_new.argtypes = [ctypes.c_int]
    lib.tkv_pool_free.argtypes = [ctypes.c_void_p]
    lib.tkv_submit.restype = ctypes.c_void_p
    # the arrays as plain addresses (``ndarray.ctypes.data``): ``data_as`` casts cost ~3 us each per submission
    lib.tkv_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.tkv_done.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.tkv_wait.restype = ctypes.c_int64
    lib.tkv_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
    lib.tkv_batch_free.argtypes = [ctypes.c_void_p]
    lib.tkv_xxh3_rows.restype = None
    lib.tkv_xxh3_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, _u64p]
    return lib


def library() -> ctypes.CDLL:
    """The loaded native library; raise :class:`EngineUnavailableError` if it cannot be built here."""
    lib = _build()
    if isinstance(lib, EngineUnavailableError):
        raise lib
    return lib


def load() -> type[DiskFile]:
    """Return :class:`NativeFile` once the library builds and loads."""
    library()
    return NativeFile


class _Pool:
    """A C thread pool and the descriptor it serves, shared by a file and its batches, so that whichever is
    collected first (the garbage collector calls weakref callbacks before ``__del__``) sees whether the pool
    still exists."""

    def __init__(self, lib: ctypes.CDLL, depth: int, fd: int) -> None:
        self.lib, self.fd = lib, fd
        self.handle: int | None = None
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= settings.MAX_IO_QUEUE_DEPTH:
            raise InvalidConfigError(
                f"the native engine's pool needs 1 to {settings.MAX_IO_QUEUE_DEPTH} I/O threads, got {depth!r} "
                f"(from {settings.source('io_queue_depth')}); set TIERKV_IO_QUEUE_DEPTH=16 or unset it."
            )
        self.handle = lib.tkv_pool_new(depth) or None

    def release(self) -> None:
        """Stop and join the threads (after the queued batches: they all finish), free the pool, close the fd."""
        handle, self.handle = self.handle, None
        try:
            if handle is not None:
                self.lib.tkv_pool_free(handle)
        finally:
            if self.fd >= 0:
                fd, self.fd = self.fd, -1
                os.close(fd)


class _NativeBatch(IOHandle):
    """A C batch; keeps the request buffers alive until the workers are done with them."""

    def __init__(self, file: NativeFile, batch: int, buffers: Any, offsets: np.ndarray, lengths: np.ndarray,
                 digests: np.ndarray | None) -> None:
        self._pool = file.pool_state
        self._path = file.path
        self._batch: int | None = batch
        self._buffers = buffers  # keep-alive: the C side holds raw addresses into these arrays
        self._digests = digests  # ... and writes into this one
        self._offsets, self._lengths = offsets, lengths  # of each request, for the error of the first that failed
        self._error: OSError | None = None

    def _finish(self) -> None:
        """Wait in C, record the first error, free the C batch. Idempotent; never raises."""
        if self._batch is None:
            return
        lib, pool = self._pool.lib, self._pool.handle
        batch, self._batch = self._batch, None
        if pool is None:  # the pool was freed, which finished every batch first
            lib.tkv_batch_free(batch)
            self._buffers, self._digests = None, None
            return
        code = ctypes.c_int32()
        failed = lib.tkv_wait(pool, batch, ctypes.byref(code))
        lib.tkv_batch_free(batch)
        if failed >= 0:
            if code.value == _EOF:
                self._error = eof_error(self._path, int(self._offsets[failed]), int(self._lengths[failed]), None)
            else:
                self._error = OSError(code.value, os.strerror(code.value), self._path)
        self._buffers, self._digests = None, None

    def wait(self) -> None:
        self._finish()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        pool = self._pool.handle
        return self._batch is None or pool is None or bool(self._pool.lib.tkv_done(pool, self._batch))

    def __del__(self) -> None:
        # An abandoned handle must not free memory that workers still write into: drain it first.
        if getattr(self, "_batch", None) is not None:
            self._finish()


class NativeFile(DiskFile):
    """A file served by the C thread pool (``queue_depth()`` workers, pieces of ``chunk_bytes()``)."""

    engine_name = "native"

    def __init__(self, path: str, direct: bool | None) -> None:
        self.lib = library()
        self.path = path
        self.fd, self.direct, self.direct_refused = open_fd(path, direct)
        self._chunk = chunk_bytes()
        depth = queue_depth()
        try:
            self.pool_state = _Pool(self.lib, depth, self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        if self.pool_state.handle is None:
            os.close(self.fd)
            raise OSError(errno.EAGAIN, f"native engine: could not start its {depth} I/O threads (the thread or "
                          "memory limit; a smaller TIERKV_IO_QUEUE_DEPTH needs fewer)", path)
        self._live: weakref.WeakSet[_NativeBatch] = weakref.WeakSet()  # finished before the pool is freed
        # dropped without close() (or alive at exit), the file still joins its C threads and closes its descriptor
        self._finalizer = weakref.finalize(self, self.pool_state.release)

    @property
    def pool(self) -> int | None:
        return self.pool_state.handle

    def submit_reads(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=False)[0]

    def submit_writes(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=True)[0]

    def submit_hashed_reads(self, requests: Sequence[tuple[int, Any]], unit: int) -> tuple[IOHandle, np.ndarray | None]:
        """The workers hash every ``unit`` bytes right after their piece landed (on the I/O threads)."""
        return self._submit(requests, write=False, unit=unit)

    def submit_array(self, offsets: np.ndarray, lengths: np.ndarray, buffer: Any, buffer_offsets: np.ndarray, *,
                     write: bool, unit: int = 0) -> tuple[IOHandle, np.ndarray | None]:
        """The arrays go to the C pool as they are: no Python per request."""
        self._open()
        batch = check_array_requests(offsets, lengths, buffer, buffer_offsets, direct=self.direct, write=write,
                                     unit=unit)
        addrs = batch.starts.astype(np.uint64) + np.uint64(batch.view.ctypes.data)
        return self._queue(batch.view, batch.offsets, batch.lengths, addrs, write, unit)

    def submit_plan(self, plan: ArrayPlan, buffer: Any) -> tuple[IOHandle, np.ndarray | None]:
        """Only the buffer is checked (:func:`~tierkv.io.base.fit_plan`): a few Python operations per batch."""
        self._open()
        view = fit_plan(plan, buffer, direct=self.direct)
        return self._queue(view, plan.offsets, plan.lengths, plan.addresses + np.uint64(view.ctypes.data), plan.write,
                           plan.unit, plan.units)  # fmt: skip

    def _open(self) -> None:
        if self.pool is None:
            raise ValueError(f"I/O on closed {self!r}.")

    def _submit(self, requests: Sequence[tuple[int, Any]], *, write: bool,
                unit: int = 0) -> tuple[IOHandle, np.ndarray | None]:
        self._open()
        checked = check_requests(requests, direct=self.direct, writable=not write)
        offsets = np.array([r.offset for r in checked], dtype=np.int64)
        lengths = np.array([r.view.nbytes for r in checked], dtype=np.int64)
        addrs = np.array([r.view.ctypes.data for r in checked], dtype=np.uint64)
        if unit and np.any(lengths % unit):
            raise ValueError(f"hashed reads need requests of whole {unit}-byte units; got lengths {lengths.tolist()}.")
        return self._queue(checked, offsets, lengths, addrs, write, unit)

    def _queue(self, buffers: Any, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, write: bool,
               unit: int, units: int | None = None) -> tuple[IOHandle, np.ndarray | None]:
        """Queue checked requests (``int64`` offsets and lengths, ``uint64`` addresses into ``buffers``, which the
        batch keeps alive) as one C batch; ``units``: the hashed units in all, where known."""
        if not offsets.size:
            return CompletedHandle(), (np.zeros(0, dtype=np.uint64) if unit else None)
        digests = None
        if unit:
            digests = np.empty(int(lengths.sum()) // unit if units is None else units, dtype=np.uint64)
        batch = self.lib.tkv_submit(
            self.pool, self.fd, int(write), self._chunk, offsets.size, offsets.ctypes.data, lengths.ctypes.data,
            addrs.ctypes.data, unit, digests.ctypes.data if digests is not None else None,
        )  # fmt: skip
        if not batch:
            raise OSError(errno.ENOMEM, "native engine: out of memory queueing a batch", self.path)
        handle = _NativeBatch(self, batch, buffers, offsets, lengths, digests)
        self._live.add(handle)
        return handle, digests

    def close(self) -> None:
        if self.pool is None:
            return
        try:
            for handle in list(self._live):  # their C batches point into the pool: finish them first
                handle._finish()
        finally:
            self._finalizer()
