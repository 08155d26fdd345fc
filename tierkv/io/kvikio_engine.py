"""The GPUDirect Storage engine: kvikio ``CuFile`` reads and writes, into GPU or host memory.

With GDS, NVMe DMAs straight into GPU memory; without it kvikio runs in *compat mode* (POSIX I/O through
its own bounce buffers), which it chooses itself from ``KVIKIO_COMPAT_MODE`` (ON/OFF/AUTO). We never
override that setting, we only report what is in effect, honestly:

- ``gds``: kvikio is not in compat mode — GDS serves reads into *device* memory;
- ``direct``: whether reads into the *host* buffers the disk tier passes bypass the page cache. kvikio reads
  host memory with POSIX ``pread`` whatever the compat mode, through the page cache unless its
  ``auto_direct_io_read`` is on and the file supports O_DIRECT.

With GDS in effect the file says ``reads_device_memory``: the disk tier then reads a CUDA store's disk blocks
straight into its device landing buffer and verifies them there (``tierkv.tiers.disk._DiskRead``); in compat
mode it reads into host bounce buffers like the other engines. Automatic selection (:mod:`tierkv.io.select`)
does not pick kvikio: for host memory the native engine's O_DIRECT is the better path, and the GDS path has
not run on a GPU yet. Force it with ``TIERKV_DISK_ENGINE=kvikio`` (or ``engine="kvikio"``).

kvikio splits each ``pread``/``pwrite`` into ``task_size`` pieces on its own thread pool
(``KVIKIO_NTHREADS``), so this engine issues one future per request and lets kvikio supply queue depth.
The module imports kvikio only inside :func:`load`, so ``import tierkv.io`` works without it.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import os
from collections.abc import Sequence
from typing import Any

from tierkv import forks, safefs
from tierkv.errors import InvalidConfigError
from tierkv.io.base import (
    CompletedHandle,
    DiskFile,
    EngineUnavailableError,
    IOHandle,
    as_byte_view,
    check_aligned,
    eof_error,
)

_INSTALL_FIX = ("Install it on a CUDA host with `pip install 'tierkv[cuda13]'` (kvikio-cu13, cupy-cuda13x) or, for a "
                "CUDA 12 driver, `pip install 'tierkv[cuda12]'` (kvikio-cu12, cupy-cuda12x).")

# kvikio reports failed POSIX calls as RuntimeError text; these are the errnos a caller acts on.
_KNOWN_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EINVAL, errno.EBADF)


@functools.cache
def _probe() -> str | None:
    """Return None if kvikio and CUDA both work here, else the reason they do not (checked once)."""
    if importlib.util.find_spec("kvikio") is None:
        return "kvikio not installed"
    try:
        import kvikio  # noqa: F401
        import kvikio.defaults  # noqa: F401
    except (ImportError, OSError) as exc:  # OSError: libcuda / libcufile missing when the extension loads
        return f"kvikio failed to load: {exc}"
    import torch

    if not torch.cuda.is_available():
        return "CUDA unavailable (torch.cuda.is_available() is False)"
    return None


def load() -> type[DiskFile]:
    """Return :class:`KvikioFile`, or raise :class:`EngineUnavailableError` with the reason."""
    reason = _probe()
    if reason is not None:
        raise EngineUnavailableError(reason, _INSTALL_FIX)
    return KvikioFile


def _compat_mode_on() -> bool:
    """Whether kvikio will use its POSIX path (its API for this changed across releases)."""
    import kvikio.defaults

    preferred = getattr(kvikio.defaults, "is_compat_mode_preferred", None)
    if preferred is not None:  # resolves AUTO against cuFile's availability
        return bool(preferred())
    getter = getattr(kvikio.defaults, "compat_mode", None)
    value = getter() if getter is not None else kvikio.defaults.get("compat_mode")
    return compat_from(value)


def compat_from(value: Any) -> bool:
    """Compat mode from ``compat_mode()``: older releases return a bool, newer a ``CompatMode`` enum, where
    ``bool(CompatMode.AUTO)`` is True although AUTO means "GDS if cuFile works": AUTO counts as compat only
    when nothing says GDS works (here: no ``is_compat_mode_preferred`` to ask), which is the safe side."""
    name = getattr(value, "name", None)
    if name is None:
        return bool(value)
    return name != "OFF"


def _host_direct_io(handle: Any) -> bool:
    """Whether kvikio reads host buffers with O_DIRECT (``auto_direct_io_read``, releases from 25.08)."""
    import kvikio.defaults

    try:
        wanted = bool(kvikio.defaults.get("auto_direct_io_read"))
    except (KeyError, ValueError, AttributeError):
        return False  # older releases: host reads always go through the page cache
    supported = getattr(handle, "is_direct_io_supported", None)
    return wanted and bool(supported()) if supported is not None else False


def _as_kvikio_buffer(buffer: Any, *, writable: bool) -> tuple[Any, int, int]:
    """Return ``(object kvikio accepts, nbytes, address)`` for a numpy array, cupy array or torch tensor.

    Torch tensors are viewed as bytes first: ``__cuda_array_interface__`` has no bfloat16 type string.
    """
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "untyped_storage"):  # torch.Tensor, CPU or CUDA
        import torch

        if not buffer.is_contiguous():
            raise ValueError("disk I/O buffers must be contiguous; got a strided torch tensor.")
        flat = buffer.reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            flat = flat.numpy()
            return flat, flat.nbytes, flat.ctypes.data
        return flat, flat.numel(), flat.data_ptr()
    interface = getattr(buffer, "__cuda_array_interface__", None)
    if interface is not None:  # cupy or numba device array
        return buffer, int(buffer.nbytes), int(interface["data"][0])
    view = as_byte_view(buffer, writable=writable)
    return view, view.nbytes, view.ctypes.data


def _as_oserror(exc: Exception, path: str) -> OSError:
    """Keep the errno of a failed kvikio call: the disk tier turns ENOSPC into DiskFullError."""
    if isinstance(exc, OSError):
        return exc
    text = str(exc)
    code = next((c for c in _KNOWN_ERRNOS if os.strerror(c).lower() in text.lower()), errno.EIO)
    return OSError(code, f"kvikio: {text}", path)


class _KvikioBatch(IOHandle):
    """Futures of one batch, each with what it must have transferred and the buffer it moves: kvikio's futures
    hold raw addresses only, so the batch keeps every buffer alive until its future is done (a caller may drop
    its own reference right after submitting)."""

    def __init__(self, path: str, pending: list[tuple[Any, int, int, Any]]) -> None:
        self._path = path
        self._pending = pending  # (IOFuture, file offset, nbytes, buffer)
        self._error: OSError | None = None
        self._finished = False

    def wait(self) -> None:
        if not self._finished:
            for future, offset, nbytes, _ in self._pending:
                try:
                    moved = future.get()
                    if moved != nbytes and self._error is None:
                        self._error = eof_error(self._path, offset, nbytes, moved)
                except Exception as exc:  # kvikio raises RuntimeError; keep waiting for the rest
                    if self._error is None:
                        self._error = _eof_or_oserror(exc, self._path, offset, nbytes)
            self._pending = []  # the buffers may go
            self._finished = True
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._finished or all(future.done() for future, _, _, _ in self._pending)


def _eof_or_oserror(exc: Exception, path: str, offset: int, nbytes: int) -> OSError:
    """kvikio reports a read that meets the end of the file as "POSIX error on pread: EOF": the same
    :func:`eof_error` the other engines raise (how many bytes landed first, kvikio does not say)."""
    if "pread: EOF" in str(exc):
        return eof_error(path, offset, nbytes, None)
    return _as_oserror(exc, path)


class KvikioFile(DiskFile):
    """A file opened with ``kvikio.CuFile(path, "r+")``; buffers may live on the GPU."""

    engine_name = "kvikio"

    def __init__(self, path: str | os.PathLike[str], direct: bool | None) -> None:
        import kvikio

        self.path = os.fspath(path)
        created = path.fd if isinstance(path, safefs.CreatedPath) else None  # a file tierkv created: its descriptor
        if created is None and not os.path.exists(self.path):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), self.path)
        self.gds = not _compat_mode_on()
        self.reads_device_memory = self.gds  # GDS: the disk tier reads into device buffers (no host bounce)
        self._file: Any = kvikio.CuFile(self.path if created is None else safefs.fd_path(created), "r+")
        self._batches: list[_KvikioBatch] = []  # edited in place: the finalizer holds this list
        self._finalizer = forks.finalize(self, _release, self._file, self._batches)
        if created is not None:
            try:
                safefs.check_same_file(created, self._file.fileno(), self.path)
            except BaseException:
                self.close()
                raise
        self.direct = _host_direct_io(self._file)
        self._aligned = bool(direct)  # only a caller that asked for direct I/O is held to its alignment: kvikio
        # itself serves an unaligned request through the page cache whatever its auto_direct_io_read
        self.direct_refused = "" if self.direct else (
            "kvikio reads host buffers with POSIX through the page cache (" +
            ("GDS serves device memory only)" if self.gds else "compat mode: no GPUDirect Storage)"))
        if direct and not self.direct:
            self.close()
            raise InvalidConfigError(
                f"direct I/O was requested but {self.direct_refused}; use engine='native' (O_DIRECT into host "
                "buffers), set KVIKIO_AUTO_DIRECT_IO_READ=1 on kvikio >= 25.08, or set TIERKV_DIRECT_IO=0."
            )
        if direct is False and self.direct:  # kvikio's own setting, process-wide: tierkv does not change it
            self.close()
            raise InvalidConfigError(
                "buffered I/O was requested (direct=False, TIERKV_DIRECT_IO=0) but kvikio reads host buffers with "
                "O_DIRECT here (KVIKIO_AUTO_DIRECT_IO_READ is on); unset KVIKIO_AUTO_DIRECT_IO_READ, use "
                "engine='posix' for buffered reads, or leave TIERKV_DIRECT_IO unset."
            )

    def submit_reads(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=False)

    def submit_writes(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        return self._submit(requests, write=True)

    def _submit(self, requests: Sequence[tuple[int, Any]], *, write: bool) -> IOHandle:
        if self._file is None:
            raise ValueError(f"I/O on closed {self!r}.")
        checked = []
        for index, (offset, buffer) in enumerate(requests):  # check all before issuing any
            obj, nbytes, address = _as_kvikio_buffer(buffer, writable=not write)
            if offset < 0:
                raise ValueError(f"request {index}: file offset {offset} is negative.")
            on_host = not hasattr(obj, "__cuda_array_interface__")  # cuFile takes any device address (GDS)
            if self._aligned and on_host:
                check_aligned(index, offset, nbytes, address)
            if nbytes:  # nothing to move (kvikio's futures need a buffer with an address)
                checked.append((offset, obj, nbytes))
        if not checked:
            return CompletedHandle()
        issue = self._file.pwrite if write else self._file.pread
        futures = [(issue(obj, nbytes, offset), offset, nbytes, obj) for offset, obj, nbytes in checked]
        batch = _KvikioBatch(self.path, futures)
        self._batches[:] = [b for b in self._batches if not b.done()] + [batch]
        return batch

    def close(self) -> None:
        if self._file is None:
            return
        self._finalizer()
        self._file = None


def _release(file: Any, batches: list[_KvikioBatch]) -> None:
    """Close a CuFile once its batches are done (kvikio must not write into buffers after close returns); also
    the finalizer of a :class:`KvikioFile` dropped without ``close()``, so no descriptor outlives it."""
    for batch in batches:
        with contextlib.suppress(OSError):  # the caller who waits on the batch sees the error
            batch.wait()
    batches.clear()
    file.close()
