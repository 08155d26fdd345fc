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

import contextlib
import ctypes
import errno
import functools
import logging
import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tierkv import cbuild, forks, settings
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
_ROUNDS = struct.Struct("<6q12Q5q")  # tkv_rounds_args, field for field
_RESULTS_AT = struct.calcsize("<6q12Q")  # failed, kind, code, request, waited_ns
_ROUND_IO, _ROUND_DIGEST, _ROUND_CONSUMER, _ROUND_NOMEM = 1, 2, 3, 4  # TKV_ROUND_* in the C source


@dataclass(frozen=True)
class RingPlan:
    """The planned rounds of a ring read (:meth:`NativeFile.run_rounds`) as the flat arrays the C loop reads: every
    round's requests in order, where each round's requests and hashed units start, and the largest extent."""

    offsets: np.ndarray  # int64 per request
    lengths: np.ndarray
    within: np.ndarray  # uint64 per request: its offset in its round's piece
    request_start: np.ndarray  # int64 [rounds + 1]
    unit_start: np.ndarray  # int64 [rounds + 1]
    largest: ArrayPlan  # the round that reaches furthest into its piece: a piece that fits it fits every round
    unit: int

    @classmethod
    def of(cls, plans: Sequence[ArrayPlan]) -> RingPlan:
        """The rounds ``plans`` (hashed reads, each into a piece of its own from its first byte), flattened."""
        if not plans or any(plan.write or not plan.unit or plan.unit != plans[0].unit for plan in plans):
            raise ValueError("a ring read's rounds are hashed reads of one unit each.")
        requests = np.cumsum([0, *(plan.offsets.size for plan in plans)], dtype=np.int64)
        units = np.cumsum([0, *(plan.units for plan in plans)], dtype=np.int64)
        return cls(np.concatenate([plan.offsets for plan in plans]), np.concatenate([plan.lengths for plan in plans]),
                   np.concatenate([plan.addresses for plan in plans]), requests, units,
                   max(plans, key=lambda plan: plan.extent), plans[0].unit)  # fmt: skip

    @property
    def rounds(self) -> int:
        return self.request_start.size - 1


class RoundsOutcome(NamedTuple):
    """How :meth:`NativeFile.run_rounds` ended: the round that failed its checksum or whose consumer refused it
    (None: every round was consumed), the consumer's status there, and the seconds spent waiting for rounds."""

    failed: int | None
    refused: bool  # the consumer's (else a checksum mismatch)
    status: int
    waited_s: float


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
    lib.tkv_rounds.argtypes = [ctypes.c_char_p]
    lib.tkv_rounds_args_size.restype = ctypes.c_int64
    if lib.tkv_rounds_args_size() != _ROUNDS.size:
        return EngineUnavailableError(f"native engine: tkv_rounds_args is {lib.tkv_rounds_args_size()} bytes, the "
                                      f"Python side packs {_ROUNDS.size}: rebuild it (pip install -e .).")
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
    still exists.

    Threads: a file may be closed on one thread while another is inside a C call on its pool (a server closing a
    cache whose request thread decodes, or the mover thread's read). Every C call holds the pool as a *user*
    (:meth:`enter` / :meth:`exit`); :meth:`release` refuses new submissions at once but frees the pool and closes
    the descriptor only when the last user is out — a pool freed under a ``tkv_submit``/``tkv_wait``, or a
    descriptor closed (and its number reused by another file) under queued writes, crashed the process or wrote
    into the wrong file."""

    def __init__(self, lib: ctypes.CDLL, depth: int, fd: int) -> None:
        self.lib, self.fd = lib, fd
        self.handle: int | None = None
        self._lock = threading.RLock()  # reentrant: a finalizer that runs while this thread holds it
        self._users = 0
        self._closing = False
        self.freed = threading.Event()  # set once the pool was freed (every batch finished) and the fd closed
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= settings.MAX_IO_QUEUE_DEPTH:
            raise InvalidConfigError(
                f"the native engine's pool needs 1 to {settings.MAX_IO_QUEUE_DEPTH} I/O threads, got {depth!r} "
                f"(from {settings.source('io_queue_depth')}); set TIERKV_IO_QUEUE_DEPTH=16 or unset it."
            )
        self.handle = lib.tkv_pool_new(depth) or None

    def enter(self, submit: bool) -> int | None:
        """The pool's handle, held until :meth:`exit`; None once it is released — for a ``submit`` already when
        the release began (the caller then makes no C call on it)."""
        with self._lock:
            if self.handle is None or (submit and self._closing):
                return None
            self._users += 1
            return self.handle

    def exit(self) -> None:
        """The end of a C call :meth:`enter` allowed; the last user out of a released pool frees it."""
        with self._lock:
            self._users -= 1
            taken = self._take() if self._closing and not self._users else None
        self._free(taken)

    def release(self) -> None:
        """Stop and join the threads (after the queued batches: they all finish), free the pool, close the fd —
        now, or when the last C call still using the pool returns."""
        with self._lock:
            self._closing = True
            taken = self._take() if not self._users else None
        self._free(taken)

    def _take(self) -> tuple[int | None, int] | None:
        """The handle and descriptor to free, taken out of the pool (under the lock), or None if taken before."""
        if self.handle is None and self.fd < 0:
            return None
        taken = (self.handle, self.fd)
        self.handle, self.fd = None, -1
        return taken

    def _free(self, taken: tuple[int | None, int] | None) -> None:
        if taken is None:
            return
        handle, fd = taken
        try:
            if handle is not None:
                self.lib.tkv_pool_free(handle)
        finally:
            try:
                if fd >= 0:
                    os.close(fd)
            finally:
                self.freed.set()


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
        self._finishing = threading.Lock()  # held while a thread waits for and frees the C batch

    def _finish(self) -> None:
        """Wait in C, record the first error, free the C batch. Idempotent; never raises. Threads that finish one
        batch at once (a ``close()`` on another thread) take turns: the later one finds it finished."""
        with self._finishing:
            if self._batch is None:
                return
            lib, state = self._pool.lib, self._pool
            pool = state.enter(submit=False)
            if pool is None:  # released: its free finishes every batch first
                state.freed.wait()
                lib.tkv_batch_free(self._batch)
                self._batch, self._buffers, self._digests = None, None, None
                return
            try:
                code = ctypes.c_int32()
                failed = lib.tkv_wait(pool, self._batch, ctypes.byref(code))
                lib.tkv_batch_free(self._batch)
                self._batch = None
            finally:
                state.exit()
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
        if self._batch is None:
            return True
        if not self._finishing.acquire(blocking=False):  # another thread is finishing it
            return False
        try:
            if self._batch is None:
                return True
            pool = self._pool.enter(submit=False)
            if pool is None:
                return self._pool.freed.is_set()
            try:
                return bool(self._pool.lib.tkv_done(pool, self._batch))
            finally:
                self._pool.exit()
        finally:
            self._finishing.release()

    def __del__(self) -> None:
        # An abandoned handle must not free memory that workers still write into: drain it first.
        if getattr(self, "_batch", None) is not None:
            self._finish()


class NativeFile(DiskFile):
    """A file served by the C thread pool (``queue_depth()`` workers, pieces of ``chunk_bytes()``)."""

    engine_name = "native"

    def __init__(self, path: str | os.PathLike[str], direct: bool | None) -> None:
        self.lib = library()
        self.path = os.fspath(path)
        self.fd, self.direct, self.direct_refused = open_fd(path, direct)
        self._chunk = chunk_bytes()
        depth = wanted = queue_depth()
        try:
            self.pool_state = _Pool(self.lib, depth, self.fd)
            while self.pool_state.handle is None and depth > 1:  # a thread or memory limit: fewer threads
                depth //= 2
                self.pool_state = _Pool(self.lib, depth, self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        if self.pool_state.handle is None:
            os.close(self.fd)
            raise OSError(errno.EAGAIN, "native engine: could not start even one I/O thread (a thread, process or "
                          "memory limit, e.g. ulimit -u or -v)", path)
        if depth < wanted:
            logger.warning("tierkv: the native disk engine could start only %d of its %d I/O threads for %s (a "
                           "thread, process or memory limit); it goes on with %d (TIERKV_IO_QUEUE_DEPTH sets how "
                           "many it starts)", depth, wanted, self.path, depth)
        self._live: weakref.WeakSet[_NativeBatch] = weakref.WeakSet()  # finished before the pool is freed
        self._live_lock = threading.Lock()
        # dropped without close() (or alive at exit), the file still joins its C threads and closes its descriptor
        self._finalizer = forks.finalize(self, self.pool_state.release)

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

    def owns(self, handle: IOHandle) -> bool:
        """Whether ``handle`` is a batch of this file's pool (which :meth:`run_rounds` can wait for in C)."""
        return isinstance(handle, _NativeBatch) and handle._pool is self.pool_state

    def run_rounds(self, ring: RingPlan, pieces: Sequence[np.ndarray], given: Sequence[IOHandle],
                   digests: Sequence[np.ndarray], expected: np.ndarray, consumer: int,
                   arguments: np.ndarray) -> RoundsOutcome:  # fmt: skip
        """Read ``ring``'s rounds through ``pieces`` (round k into piece ``k % len(pieces)``) and hand each, once it
        landed and its digests (into ``digests[k]``) equal ``expected[unit_start[k]:unit_start[k + 1]]``, to the C
        function at address ``consumer`` (``int f(const char *)``) with ``arguments[k]`` (an address): one C call for
        every round, no Python between rounds. The first ``len(given)`` rounds were submitted already (their
        handles, from :meth:`submit_plan` into their pieces); each later round is submitted once the loop reached
        the round after the one its piece held. The first failure stops the loop: an I/O error of a round submitted
        here raises (as :meth:`IOHandle.wait` does; a given round's error is its handle's); a checksum mismatch or a
        consumer's nonzero status is returned. Nothing is in flight afterwards; the given handles are waited on by
        their owner, as before."""
        self._open()
        rounds = ring.rounds
        if not (len(given) <= min(len(pieces), rounds) and len(digests) == rounds and arguments.size == rounds
                and arguments.dtype == np.uint64 and expected.dtype == np.uint64
                and expected.size == int(ring.unit_start[-1]) and pieces):  # fmt: skip
            raise ValueError(f"run_rounds: {rounds} rounds need a digest array and an argument each, the expected "
                             f"digests of {int(ring.unit_start[-1])} units, and at most one given handle per piece.")
        for k, array in enumerate(digests):
            if array.dtype != np.uint64 or array.size < ring.unit_start[k + 1] - ring.unit_start[k]:
                raise ValueError(f"run_rounds: round {k}'s digest array holds {array.size} uint64, it needs "
                                 f"{int(ring.unit_start[k + 1] - ring.unit_start[k])}.")
        if not all(self.owns(handle) for handle in given):
            raise ValueError("run_rounds: the given rounds must be this file's batches.")
        for handle in given:  # one waited for already (settled): its failure, if it had one, before its bytes are used
            if handle._batch is None:  # type: ignore[attr-defined]
                handle.wait()
        views = [fit_plan(ring.largest, piece, direct=self.direct) for piece in pieces]
        piece_addresses = np.array([view.ctypes.data for view in views], dtype=np.uint64)
        digest_addresses = np.array([array.ctypes.data for array in digests], dtype=np.uint64)
        batches = np.array([handle._batch or 0 for handle in given], dtype=np.uint64)  # type: ignore[attr-defined]
        with self._holding_pool() as pool:
            packed = ctypes.create_string_buffer(_ROUNDS.pack(
                rounds, len(pieces), len(given), self.fd, self._chunk, ring.unit, pool, ring.request_start.ctypes.data,
                ring.offsets.ctypes.data, ring.lengths.ctypes.data, ring.within.ctypes.data,
                piece_addresses.ctypes.data, digest_addresses.ctypes.data, ring.unit_start.ctypes.data,
                expected.ctypes.data, batches.ctypes.data, consumer, arguments.ctypes.data, 0, 0, 0, 0, 0),
                _ROUNDS.size)  # fmt: skip
            if self.lib.tkv_rounds(packed):
                raise ValueError("run_rounds: the C loop refused its arguments.")
        failed, kind, code, request, waited = struct.unpack_from("<5q", packed, _RESULTS_AT)
        if kind == _ROUND_NOMEM:
            raise OSError(errno.ENOMEM, "native engine: out of memory queueing a round", self.path)
        if kind == _ROUND_IO and failed < len(given):
            given[failed].wait()  # raises its error
        if kind == _ROUND_IO:
            if code == _EOF:
                raise eof_error(self.path, int(ring.offsets[request]), int(ring.lengths[request]), None)
            raise OSError(code, os.strerror(code), self.path)
        return RoundsOutcome(None if failed < 0 else failed, kind == _ROUND_CONSUMER, code, waited * 1e-9)

    def _open(self) -> None:
        if self.pool is None:
            raise ValueError(f"I/O on closed {self!r}.")

    @contextlib.contextmanager
    def _holding_pool(self) -> Iterator[int]:
        """The pool, held for the C calls that submit inside the block (:meth:`_Pool.enter`); closed meanwhile (a
        ``close()`` on another thread after :meth:`_open`'s check): the same error as a closed file's."""
        pool = self.pool_state.enter(submit=True)
        if pool is None:
            raise ValueError(f"I/O on closed {self!r}.")
        try:
            yield pool
        finally:
            self.pool_state.exit()

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
        with self._holding_pool() as pool:
            batch = self.lib.tkv_submit(
                pool, self.fd, int(write), self._chunk, offsets.size, offsets.ctypes.data, lengths.ctypes.data,
                addrs.ctypes.data, unit, digests.ctypes.data if digests is not None else None,
            )  # fmt: skip
            if not batch:
                raise OSError(errno.ENOMEM, "native engine: out of memory queueing a batch", self.path)
            handle = _NativeBatch(self, batch, buffers, offsets, lengths, digests)
            with self._live_lock:
                self._live.add(handle)
        return handle, digests

    def close(self) -> None:
        if self.pool is None:
            return
        try:
            with self._live_lock:  # a thread submitting meanwhile adds to it
                live = list(self._live)
            for handle in live:  # their C batches point into the pool: finish them first
                handle._finish()
        finally:
            self._finalizer()
