"""What every disk engine shares: the file ABC, the batch handle, aligned buffers and request checks.

An engine moves *batches* of ``(file offset, buffer)`` requests, never single blocks: the disk tier
coalesces adjacent slots into large requests and submits a whole step's worth at once, so an engine can
keep many requests in flight (NVMe needs a queue depth of 16 or more to reach its bandwidth). Each batch
returns one :class:`IOHandle`; the caller overlaps it with compute and waits only when the data is needed.

Direct I/O (``O_DIRECT``) bypasses the page cache, which is what a tier of KV that is larger than RAM
wants (the cache would only evict the host tier's pages). Linux then requires the file offset, the
length and the buffer address of every request to be multiples of the logical block size; :data:`ALIGN`
(4 KiB) covers every NVMe and ext4/xfs setup we target. :func:`aligned_empty` makes buffers that satisfy it.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from tierkv import safefs, settings
from tierkv.errors import InvalidConfigError, TierKVError

ALIGN: int = settings.DIRECT_IO_ALIGN
"""Alignment in bytes of offsets, lengths and addresses for direct I/O (4 KiB)."""

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


class AlignmentError(TierKVError, ValueError):
    """A direct-I/O request whose offset, length or buffer address is not a multiple of :data:`ALIGN`."""


HUGE_PAGE = 2 * 2**20
"""Buffers of at least this many bytes ask for transparent huge pages (see :func:`aligned_empty`)."""

_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


def aligned_empty(nbytes: int) -> np.ndarray:
    """Return an uninitialised ``uint8`` array of ``nbytes`` whose base address is aligned to :data:`ALIGN`.

    It lives in a private anonymous ``mmap``: the kernel hands out whole pages, so the address is page aligned
    without over-allocating and slicing, and the pages are only touched when first written.

    Buffers of :data:`HUGE_PAGE` or more are advised to use transparent huge pages (``MADV_HUGEPAGE``; Linux
    in its default ``madvise`` THP mode honours it for private mappings only, hence ``MAP_PRIVATE``). Why:
    an ``O_DIRECT`` request is split by the block layer at its device's segment limit (254 on virtio-blk), and
    each physically discontiguous 4 KiB page is a segment, so a 4 MiB read into scattered small pages reached
    the disk as ~5 requests of 1 MiB. With huge pages a 4 MiB piece reaches the disk as one or two requests: about
    half the device requests per decode step (docs/architecture.md, "Disk reads").

    >>> buf = aligned_empty(10_000)
    >>> buf.ctypes.data % ALIGN, buf.nbytes
    (0, 10000)
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes={nbytes} is negative.")
    # mmap refuses length 0; the array below still has 0 bytes
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if nbytes >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: small pages, still correct
            region.madvise(_MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8, count=nbytes)


def as_byte_view(buffer: Any, *, writable: bool) -> np.ndarray:
    """Return ``buffer`` as a flat ``uint8`` numpy view of the same memory (never a copy).

    Accepts numpy arrays (any dtype, C-contiguous) and objects with the buffer protocol (``bytearray``,
    ``mmap``, ``memoryview``). A copy would silently break reads (data lands in the copy), so a
    non-contiguous or read-only buffer is an error instead.
    """
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("disk I/O buffers must be C-contiguous; got a strided numpy array.")
        view = buffer.reshape(-1).view(np.uint8)
    else:
        try:
            view = np.frombuffer(buffer, dtype=np.uint8)
        except TypeError as exc:
            raise TypeError(
                f"disk I/O buffer of type {type(buffer).__name__} has no buffer protocol; pass a numpy array "
                "(for a CPU torch tensor use tensor.view(torch.uint8).numpy())."
            ) from exc
    if writable and not view.flags.writeable:
        raise ValueError("a read needs a writable buffer; got a read-only one.")
    return view


@dataclass(frozen=True, slots=True)
class Request:
    """One checked request: ``nbytes`` at file ``offset`` to/from the memory at ``view``."""

    index: int  # position in the submitted batch, to report the first error in submission order
    offset: int
    view: np.ndarray  # [nbytes] uint8


def check_requests(
    requests: Sequence[tuple[int, Any]], *, direct: bool, writable: bool
) -> list[Request]:
    """Validate a batch before anything is submitted, so a bad request never leaves half a batch done."""
    checked = []
    for index, (offset, buffer) in enumerate(requests):
        view = as_byte_view(buffer, writable=writable)
        if offset < 0:
            raise ValueError(f"request {index}: file offset {offset} is negative.")
        if direct:
            check_aligned(index, offset, view.nbytes, view.ctypes.data)
        checked.append(Request(index, offset, view))
    return checked


def check_aligned(index: int, offset: int, nbytes: int, address: int) -> None:
    """Raise :class:`AlignmentError` for request ``index`` of a direct-I/O batch unless its offset, length and
    buffer address are multiples of :data:`ALIGN`."""
    bad = [f"{name}={value} ({value % ALIGN} past a multiple)"
           for name, value in (("offset", offset), ("nbytes", nbytes), ("address", address)) if value % ALIGN]
    if bad:
        raise AlignmentError(
            f"request {index}: direct I/O needs offset, length and buffer address aligned to {ALIGN} bytes; "
            f"misaligned: {', '.join(bad)}. Allocate buffers with tierkv.io.aligned_empty and size slots in "
            "multiples of ALIGN, or open the file with direct=False."
        )


@dataclass(frozen=True, slots=True)
class ArrayRequests:
    """A checked array batch: request ``i`` moves ``lengths[i]`` bytes between file offset ``offsets[i]`` and
    ``view[starts[i] : starts[i] + lengths[i]]`` (all ``int64 [n]``)."""

    view: np.ndarray  # [nbytes] uint8: the one buffer every request lands in or comes from
    offsets: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray


def _int64_array(name: str, values: Any) -> np.ndarray:
    """``values`` as a contiguous 1-D int64 array (never truncated or wrapped), or a ValueError naming ``name``."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1 and values.flags.c_contiguous:
        return values  # already what C takes (the page read's arrays): no conversion to pay for
    array = np.asarray(values)
    if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
        raise ValueError(f"{name} must be a 1-D array of integers; got {array.dtype} of shape {array.shape}.")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(array.max())}, past the int64 range of file and buffer offsets.")
    return np.ascontiguousarray(array, dtype=np.int64)  # the native engine hands its memory to C


def check_array_requests(offsets: Any, lengths: Any, buffer: Any, buffer_offsets: Any, *, direct: bool, write: bool,
                         unit: int = 0) -> ArrayRequests:
    """Validate an array batch (see :meth:`DiskFile.submit_array`) with numpy, before anything is submitted: what
    :func:`check_requests` checks per request (the buffer contiguous and, for a read, writable; file offsets not
    negative; under ``O_DIRECT`` offset, length and memory address multiples of :data:`ALIGN`), plus what one shared
    buffer adds (each request inside it) and, with ``unit``, lengths of whole units. The error names the first bad
    request in submission order."""
    _check_unit(unit, write)
    view = as_byte_view(buffer, writable=not write)
    offsets, lengths = _int64_array("offsets", offsets), _int64_array("lengths", lengths)
    starts = _int64_array("buffer_offsets", buffer_offsets)
    _check_shapes(offsets, lengths, starts)
    address = view.ctypes.data + starts if direct else starts
    # one pass over all the checks at once (a few numpy calls, whatever the batch's size): the common case is a
    # good batch; only a bad one pays for finding which check its first bad request fails
    either = offsets | lengths  # negative, or misaligned (ALIGN is a power of two), iff one of them is
    bad = ((either | starts) < 0) | (starts > view.nbytes - lengths)
    if unit:
        bad |= lengths % unit != 0
    if direct:
        bad |= (either | address) % ALIGN != 0
    if bad.any():
        _raise_first(offsets, lengths, starts, address, view.nbytes, direct=direct, unit=unit)
    return ArrayRequests(view, offsets, lengths, starts)


@dataclass(frozen=True, slots=True)
class ArrayPlan:
    """An array batch checked for everything that its buffer does not decide (:func:`plan_array_requests`), to
    submit again and again (:meth:`DiskFile.submit_plan`: a disk read's rounds, every decode step) into buffers of at
    least ``extent`` bytes; each buffer then costs a check of its size and address, not of every request."""

    offsets: np.ndarray  # int64 [n]
    lengths: np.ndarray
    starts: np.ndarray  # into the buffer; multiples of ALIGN for direct I/O
    addresses: np.ndarray  # uint64 [n]: the starts, to add a buffer's address to
    extent: int  # the bytes of buffer the requests reach
    write: bool
    unit: int
    units: int  # hashed units in all (0 without unit)

    def split(self, cuts: Sequence[int]) -> list[ArrayPlan]:
        """The requests cut at indices ``cuts`` into consecutive plans, each reaching only its own requests' bytes
        (checked already: each is a part of this one)."""
        bounds = [0, *cuts, self.offsets.size]
        plans = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            offsets, lengths, starts = self.offsets[a:b], self.lengths[a:b], self.starts[a:b]
            plans.append(ArrayPlan(offsets, lengths, starts, self.addresses[a:b],
                                   int((starts + lengths).max(initial=0)), self.write, self.unit,
                                   int(lengths.sum()) // self.unit if self.unit else 0))  # fmt: skip
        return plans


def plan_array_requests(offsets: Any, lengths: Any, buffer_offsets: Any, *, direct: bool, write: bool,
                        unit: int = 0) -> ArrayPlan:
    """An array batch checked as :func:`check_array_requests` checks it, except for what the buffer decides (its
    size, its address): under ``O_DIRECT`` the buffer offsets must be multiples of :data:`ALIGN` themselves (a
    buffer at an aligned address then aligns every request). Raises as it does; :func:`fit_plan` checks a
    buffer."""
    _check_unit(unit, write)
    offsets, lengths = _int64_array("offsets", offsets), _int64_array("lengths", lengths)
    starts = _int64_array("buffer_offsets", buffer_offsets)
    _check_shapes(offsets, lengths, starts)
    extent = int((starts + lengths).max(initial=0))
    bad = (offsets | lengths | starts) < 0
    if unit:
        bad |= lengths % unit != 0
    if direct:
        bad |= (offsets | lengths | starts) % ALIGN != 0
    if bad.any():  # with room for every request: only the checks that do not depend on the buffer can fail
        _raise_first(offsets, lengths, starts, starts, max(extent, 0), direct=direct, unit=unit)
    return ArrayPlan(offsets, lengths, starts, starts.astype(np.uint64), extent, write, unit,
                     int(lengths.sum()) // unit if unit else 0)  # fmt: skip


def fit_plan(plan: ArrayPlan, buffer: Any, *, direct: bool) -> np.ndarray:
    """``buffer`` as the byte view :meth:`DiskFile.submit_plan` moves ``plan``'s requests through, checked: large
    enough, and at an aligned address for direct I/O. A buffer that fails gets :func:`check_array_requests`' error
    for the first request it fails."""
    view = as_byte_view(buffer, writable=not plan.write)
    if plan.extent <= view.nbytes and not (direct and view.ctypes.data % ALIGN):
        return view
    check_array_requests(plan.offsets, plan.lengths, view, plan.starts, direct=direct, write=plan.write,
                         unit=plan.unit)  # fmt: skip
    return view  # (unreachable for a plan that passed plan_array_requests: the check above raises)


def _check_unit(unit: int, write: bool) -> None:
    if isinstance(unit, bool) or not isinstance(unit, int | np.integer) or unit < 0 or (write and unit):
        raise ValueError(f"unit must be a byte count >= 0 for reads (0: no hashing) and 0 for writes; got {unit!r}.")


def _check_shapes(offsets: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> None:
    if not offsets.shape == lengths.shape == starts.shape:
        raise ValueError(f"offsets, lengths and buffer_offsets must have one entry per request; got "
                         f"{offsets.size}, {lengths.size} and {starts.size}.")


def _raise_first(offsets: np.ndarray, lengths: np.ndarray, starts: np.ndarray, address: np.ndarray, nbytes: int, *,
                 direct: bool, unit: int) -> NoReturn:
    """Raise the error of the first bad request of an array batch (in submission order), for the first check it
    fails in :func:`check_requests`' order."""
    checks = [
        (offsets < 0, lambda i: f"file offset {offsets[i]} is negative."),
        (lengths < 0, lambda i: f"length {lengths[i]} is negative."),
        ((starts < 0) | (starts > nbytes - lengths),
         lambda i: f"bytes {starts[i]}..{starts[i] + lengths[i]} of the buffer are outside its {nbytes} bytes."),
    ]
    if unit:
        checks.append((lengths % unit != 0, lambda i: f"length {lengths[i]} is not a multiple of the unit {unit} "
                       "(hashed reads need requests of whole units)."))
    if direct:
        checks.append(((offsets % ALIGN != 0) | (lengths % ALIGN != 0) | (address % ALIGN != 0), lambda i: (
            f"direct I/O needs offset, length and buffer address aligned to {ALIGN} bytes; misaligned: "
            + ", ".join(f"{name}={value} ({value % ALIGN} past a multiple)" for name, value in
                        (("offset", offsets[i]), ("nbytes", lengths[i]), ("address", address[i])) if value % ALIGN)
            + ". Allocate buffers with tierkv.io.aligned_empty and size slots in multiples of ALIGN, or open the "
            "file with direct=False.")))
    firsts = [int(np.argmax(bad)) if bad.any() else offsets.size for bad, _ in checks]
    first = min(firsts)
    which = firsts.index(first)  # checks in check_requests' order: the first that request fails
    error = AlignmentError if direct and which == len(checks) - 1 else ValueError
    raise error(f"request {first}: {checks[which][1](first)}")


class EndOfFileError(OSError):
    """A read that hit end of file: the file is shorter than what was written to it (truncated by someone else;
    a KV block that was never written would be a bug upstream)."""


def eof_error(path: str, offset: int, wanted: int, got: int | None) -> EndOfFileError:
    """The :class:`EndOfFileError` of a read of ``wanted`` bytes at ``offset`` that got only ``got``."""
    short = "" if got is None else f", got {got}"
    return EndOfFileError(errno.EIO, f"read past end of file: wanted {wanted} bytes at offset {offset}{short}", path)


def open_fd(path: str | os.PathLike[str], direct: bool | None) -> tuple[int, bool, str]:
    """Open an existing file read/write; return ``(fd, direct in effect, reason if direct was refused)``.

    ``direct=None`` tries ``O_DIRECT`` and falls back to buffered I/O when the filesystem refuses it
    (EINVAL at open, or at the first aligned read, which is where some filesystems report it).
    ``direct=True`` makes a refusal an error that says how to fix it. A file tierkv created (a
    :class:`~tierkv.safefs.CreatedPath`) is opened, both times, from the descriptor it was created through and
    checked to be that file (:func:`tierkv.safefs.reopen`), never by name; any other path is opened by name, and
    a symbolic link there is refused (ELOOP).
    """
    if direct is False or not _O_DIRECT:
        if direct and not _O_DIRECT:
            raise InvalidConfigError("direct I/O was requested but this OS has no O_DIRECT; use direct=False")
        reason = "" if direct is False else "O_DIRECT not supported by this OS"
        return safefs.open_path(path, os.O_RDWR), False, reason
    try:
        fd = safefs.open_path(path, os.O_RDWR | _O_DIRECT)
        _probe_direct(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if direct:
            raise InvalidConfigError(
                f"the filesystem of {os.fspath(path)} refuses O_DIRECT (EINVAL); put the disk tier on a filesystem "
                "that supports it (ext4, xfs) or set TIERKV_DIRECT_IO=0 for buffered I/O."
            ) from exc
        return safefs.open_path(path, os.O_RDWR), False, "filesystem refuses O_DIRECT"
    return fd, True, ""


def _probe_direct(fd: int) -> None:
    """Read one aligned block (if the file has one) so a filesystem that accepts the flag but not the I/O
    is caught at open, not in the middle of a decode step. Closes ``fd`` before re-raising."""
    try:
        if os.fstat(fd).st_size >= ALIGN:
            os.preadv(fd, [aligned_empty(ALIGN).data], 0)
    except OSError:
        os.close(fd)
        raise


class IOHandle(ABC):
    """Completion of one submitted batch. Engines subclass it around their own completion mechanism."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every request of the batch finished; then raise the first failure, in submission
        order, as an ``OSError`` carrying its errno (e.g. ``ENOSPC``). Waiting again re-raises it."""

    @abstractmethod
    def done(self) -> bool:
        """Return True once every request finished (successfully or not); never blocks."""


class CompletedHandle(IOHandle):
    """The handle of an empty batch: nothing to wait for."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class DiskFile(ABC):
    """One open file through one engine. A context manager; :meth:`close` is idempotent.

    Subclasses set :attr:`engine_name` and :attr:`direct` and implement the two submit methods; the
    batch is checked (alignment, writability) before anything is issued.
    """

    engine_name: str
    direct: bool
    direct_refused: str  # why O_DIRECT is not in effect when it was tried ("" otherwise)
    path: str
    reads_device_memory: bool = False
    """Reads may target GPU memory without a host bounce (kvikio with GPUDirect Storage); the disk tier then
    reads into the device landing buffer and verifies there."""

    @abstractmethod
    def __init__(self, path: str | os.PathLike[str], direct: bool | None) -> None:
        """Open the existing file ``path`` (one tierkv created: from its descriptor): O_DIRECT required with
        ``direct=True``, the page cache with ``False``, O_DIRECT where the filesystem accepts it with ``None``
        (see :func:`open_fd`)."""

    @abstractmethod
    def submit_reads(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        """Read ``len(buffer)`` bytes at each ``offset`` into ``buffer``; all requests may run at once."""

    @abstractmethod
    def submit_writes(self, requests: Sequence[tuple[int, Any]]) -> IOHandle:
        """Write each ``buffer`` at its ``offset``; all requests may run at once."""

    def submit_hashed_reads(self, requests: Sequence[tuple[int, Any]], unit: int) -> tuple[IOHandle, np.ndarray | None]:
        """Like :meth:`submit_reads`; an engine that can also hash what lands returns the xxh3-64 of every
        ``unit`` bytes (requests in order) in an array valid once the handle was waited on. This one cannot:
        ``None``, the caller hashes (:func:`tierkv.io.checksum.xxh3_rows`)."""
        return self.submit_reads(requests), None

    def submit_array(self, offsets: np.ndarray, lengths: np.ndarray, buffer: Any, buffer_offsets: np.ndarray, *,
                     write: bool, unit: int = 0) -> tuple[IOHandle, np.ndarray | None]:
        """Submit ``len(offsets)`` requests between one host ``buffer`` and the file, given as arrays: request ``i``
        moves ``lengths[i]`` bytes between file offset ``offsets[i]`` and the buffer's bytes from
        ``buffer_offsets[i]``. Checked as a whole first (:func:`check_array_requests`: the tuple methods' checks,
        vectorized, plus each request inside the buffer); a batch of thousands of small requests (a page read's
        sectors) then costs no Python per request where the engine takes arrays (native). With ``unit`` (reads
        only) the second value is as :meth:`submit_hashed_reads`'s; else None.

        This default cuts the batch into the tuple form for :meth:`submit_reads` and friends."""
        batch = check_array_requests(offsets, lengths, buffer, buffer_offsets, direct=self.direct, write=write,
                                     unit=unit)
        requests = [(offset, batch.view[start : start + length]) for offset, start, length in
                    zip(batch.offsets.tolist(), batch.starts.tolist(), batch.lengths.tolist())]
        if write:
            return self.submit_writes(requests), None
        if unit:
            return self.submit_hashed_reads(requests, unit)
        return self.submit_reads(requests), None

    def plan_array(self, offsets: np.ndarray, lengths: np.ndarray, buffer_offsets: np.ndarray, *, write: bool,
                   unit: int = 0) -> ArrayPlan:
        """:func:`plan_array_requests` for this file's I/O mode: a batch to submit into many buffers."""
        return plan_array_requests(offsets, lengths, buffer_offsets, direct=self.direct, write=write, unit=unit)

    def submit_plan(self, plan: ArrayPlan, buffer: Any) -> tuple[IOHandle, np.ndarray | None]:
        """:meth:`submit_array` of a batch checked once (:func:`plan_array_requests`) into ``buffer``. This default
        checks it again in full; an engine that takes arrays checks only the buffer (:func:`fit_plan`)."""
        return self.submit_array(plan.offsets, plan.lengths, buffer, plan.starts, write=plan.write, unit=plan.unit)

    @abstractmethod
    def close(self) -> None:
        """Wait for in-flight requests, then release the file. Safe to call twice."""

    def read(self, offset: int, buffer: Any) -> None:
        """Blocking single read (convenience for tests and tools)."""
        self.submit_reads([(offset, buffer)]).wait()

    def write(self, offset: int, buffer: Any) -> None:
        """Blocking single write (convenience for tests and tools)."""
        self.submit_writes([(offset, buffer)]).wait()

    def __enter__(self) -> DiskFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "O_DIRECT" if self.direct else "buffered"
        return f"<{type(self).__name__} {self.engine_name} {mode} {self.path!r}>"


def queue_depth() -> int:
    """Requests in flight per file (setting ``io_queue_depth``, ``TIERKV_IO_QUEUE_DEPTH``; 16 by default,
    where NVMe reaches its bandwidth)."""
    return int(settings.get("io_queue_depth"))


def chunk_bytes() -> int:
    """Largest single I/O an engine issues (setting ``io_chunk``, ``TIERKV_IO_CHUNK``; 4 MiB by default).

    A 1 GiB request issued as one ``pread`` would run at queue depth 1; cutting it into chunks lets the
    workers keep the device busy. 4 MiB is past the size where per-call overhead matters.
    """
    return int(settings.get("io_chunk"))


def split(requests: list[Request], chunk: int) -> list[tuple[int, int, np.ndarray]]:
    """Cut requests into ``(request index, offset, view)`` pieces of at most ``chunk`` bytes.

    ``chunk`` is a multiple of :data:`ALIGN`, so pieces of an aligned request stay aligned.
    """
    pieces = []
    for req in requests:
        nbytes = req.view.nbytes
        for start in range(0, max(nbytes, 1), chunk):
            pieces.append((req.index, req.offset + start, req.view[start : start + chunk]))
    return pieces


class EngineUnavailableError(TierKVError, RuntimeError):
    """An engine cannot load on this host; ``reason`` says why and ``fix`` what would make it load."""

    def __init__(self, reason: str, fix: str = "") -> None:
        super().__init__(f"{reason}. {fix}".strip())
        self.reason = reason
        self.fix = fix
