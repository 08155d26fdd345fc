"""The native engine: ``native_src/tierkv_io.c`` compiled on first use and driven through ctypes.

Build, FlashInfer-style: the first :func:`load` compiles the C source with the system compiler (``$CC``,
else ``cc``) into a per-user cache (``$TIERKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/tierkv``, else
``~/.cache/tierkv``) under a name that carries a hash of the source, so an edited source rebuilds and
concurrent processes never load a half-written library (it is written aside and renamed into place).
The outcome, success or the reason of failure, is cached for the process (``functools.cache``): a
missing compiler costs one lookup, not one per opened file.

The canonical C source lives inside the package so that wheels ship it; ``native/`` at the repository
root only points here (see ``native/README.md``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tierkv.io.base import (
    CompletedHandle,
    DiskFile,
    EngineUnavailableError,
    IOHandle,
    check_requests,
    chunk_bytes,
    eof_error,
    open_fd,
    queue_depth,
)

SOURCE = Path(__file__).with_name("native_src") / "tierkv_io.c"
_EOF = -1  # TKV_EOF in the C source
_CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
_FIX = "Install a C compiler (e.g. `apt-get install gcc`) or set CC, or use TIERKV_DISK_ENGINE=posix."

_i64p = ctypes.POINTER(ctypes.c_int64)


def cache_dir() -> Path:
    """Where compiled libraries are kept (per user, survives restarts, safe to delete)."""
    if root := os.environ.get("TIERKV_CACHE_DIR"):
        return Path(root) / "native"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "tierkv" / "native"


def _compile(target: Path) -> None:
    """Compile :data:`SOURCE` into ``target``; raise :class:`EngineUnavailableError` saying why not."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or "cc"]
    if shutil.which(compiler[0]) is None:
        raise EngineUnavailableError(f"no C compiler ({compiler[0]!r} not found)", _FIX)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*compiler, *_CFLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            raise EngineUnavailableError(f"compiling {SOURCE.name} failed: {tail[0]}", _FIX)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@functools.cache
def _build() -> ctypes.CDLL | EngineUnavailableError:
    """Compile (once per source version) and load the library; return the error instead of raising so
    that the failure, too, is cached."""
    try:
        digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:16]
    except OSError as exc:
        return EngineUnavailableError(f"C source missing ({exc})", "Reinstall tierkv.")
    target = cache_dir() / f"tierkv_io-{digest}.so"
    try:
        if not target.exists():
            _compile(target)
        lib = ctypes.CDLL(str(target))
    except EngineUnavailableError as exc:
        return exc
    except (OSError, subprocess.SubprocessError) as exc:
        return EngineUnavailableError(f"building or loading {target} failed ({exc})", _FIX)
    lib.tkv_pool_new.restype = ctypes.c_void_p
    lib.tkv_pool_new.argtypes = [ctypes.c_int]
    lib.tkv_pool_free.argtypes = [ctypes.c_void_p]
    lib.tkv_submit.restype = ctypes.c_void_p
    lib.tkv_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                               _i64p, _i64p, ctypes.POINTER(ctypes.c_uint64)]  # fmt: skip
    lib.tkv_done.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.tkv_wait.restype = ctypes.c_int64
    lib.tkv_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
    lib.tkv_batch_free.argtypes = [ctypes.c_void_p]
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


class _NativeBatch(IOHandle):
    """A C batch; keeps the request buffers alive until the workers are done with them."""

    def __init__(self, file: NativeFile, batch: int, requests: list[Any]) -> None:
        self._file = file
        self._batch: int | None = batch
        self._requests = requests  # keep-alive: the C side holds raw addresses into these arrays
        self._error: OSError | None = None

    def _finish(self) -> None:
        """Wait in C, record the first error, free the C batch. Idempotent; never raises."""
        if self._batch is None:
            return
        code = ctypes.c_int32()
        failed = self._file.lib.tkv_wait(self._file.pool, self._batch, ctypes.byref(code))
        self._file.lib.tkv_batch_free(self._batch)
        self._batch = None
        if failed >= 0:
            req = self._requests[failed]
            if code.value == _EOF:
                self._error = eof_error(self._file.path, req.offset, req.view.nbytes, None)
            else:
                self._error = OSError(code.value, os.strerror(code.value), self._file.path)
        self._requests = []

    def wait(self) -> None:
        self._finish()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._batch is None or bool(self._file.lib.tkv_done(self._file.pool, self._batch))

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
        self.pool: int | None = self.lib.tkv_pool_new(queue_depth())
        if not self.pool:
            os.close(self.fd)
            raise OSError(errno.ENOMEM, "native engine: could not start its I/O threads", path)
        self._live: weakref.WeakSet[_NativeBatch] = weakref.WeakSet()  # finished before the pool is freed

    def submit_reads(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=False)

    def submit_writes(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=True)

    def _submit(self, requests: Sequence[tuple[int, Any]], *, write: bool) -> IOHandle:
        if self.pool is None:
            raise ValueError(f"I/O on closed {self!r}.")
        checked = check_requests(requests, direct=self.direct, writable=not write)
        if not checked:
            return CompletedHandle()
        offsets = np.array([r.offset for r in checked], dtype=np.int64)
        lengths = np.array([r.view.nbytes for r in checked], dtype=np.int64)
        addrs = np.array([r.view.ctypes.data for r in checked], dtype=np.uint64)
        batch = self.lib.tkv_submit(
            self.pool, self.fd, int(write), self._chunk, len(checked),
            offsets.ctypes.data_as(_i64p), lengths.ctypes.data_as(_i64p),
            addrs.ctypes.data_as(ctypes.POINTER(ctypes.c_uint64)),
        )  # fmt: skip
        if not batch:
            raise OSError(errno.ENOMEM, "native engine: out of memory queueing a batch", self.path)
        handle = _NativeBatch(self, batch, checked)
        self._live.add(handle)
        return handle

    def close(self) -> None:
        if self.pool is None:
            return
        for handle in list(self._live):  # their C batches point into the pool: finish them first
            handle._finish()
        self.lib.tkv_pool_free(self.pool)
        self.pool = None
        os.close(self.fd)
