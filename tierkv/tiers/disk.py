"""The disk tier: one preallocated file per slot size, slots at aligned offsets, I/O through tierkv.io.

The file grows in extents reserved with ``posix_fallocate`` (so a full filesystem fails early, at growth,
with ENOSPC — never halfway through a block write) up to the tier's budget. Files are deleted on
:meth:`DiskTier.close` and, as a safety net, at interpreter exit.

A read of a layer's disk blocks is one batched engine call into an aligned bounce buffer (adjacent slots
coalesce into one request); it is submitted in :meth:`DiskTier.start_read` and runs on the engine's own
threads while the caller copies the layer's memory blocks, then lands in the destination.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tierkv.blocks import Tier
from tierkv.errors import DiskFullError, DiskTierError, TierKVError
from tierkv.io import DiskFile, IOHandle, aligned_empty, open_disk_file
from tierkv.layout import BlockLayout
from tierkv.tiers.base import BounceLike, Dest, Scratch, landing_pieces
from tierkv.tiers.slots import SlotPool, growth_slots

DEFAULT_EXTENT_BYTES = 256 * 2**20


def _remove_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class DiskSlotFile(SlotPool):
    """Slots of ``slot_bytes`` in one file, opened through a disk engine."""

    def __init__(self, directory: Path, prefix: str, slot_bytes: int, engine: str | None) -> None:
        super().__init__()
        self.slot_bytes = slot_bytes
        fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=f"-{slot_bytes}.kv")
        self.path = Path(name)
        try:
            self.file: DiskFile = open_disk_file(self.path, engine=engine)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._fd = fd

    def grow(self, slots: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, (self.capacity + slots) * self.slot_bytes)
        except OSError as exc:
            raise disk_error(exc, self.path) from exc
        self.slots.grow(slots)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def close(self) -> None:
        try:
            self.file.close()
        finally:
            os.close(self._fd)


class DiskTier:
    """Block slots on disk under ``directory``, at most ``budget`` bytes of files."""

    kind = Tier.DISK
    device = torch.device("cpu")  # where its reads land before they are copied on

    def __init__(self, directory: str | os.PathLike, budget: int | None, free_fraction: float = 0.9,
                 engine: str | None = None, extent_bytes: int = DEFAULT_EXTENT_BYTES) -> None:
        """``budget`` None: ``free_fraction`` of the free space of ``directory`` (created if missing)."""
        self.directory = Path(directory)
        self.engine = engine
        self.extent_bytes = extent_bytes
        self.files: dict[int, DiskSlotFile] = {}
        self.peak_bytes = 0
        self._paths: list[Path] = []
        self._prefix = f"tierkv-{os.getpid()}-"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=self._prefix):
                pass
        except OSError as exc:
            raise DiskTierError(
                exc.errno, f"disk_dir {str(self.directory)!r} is not writable ({exc.strerror}); pass a directory you "
                "can write to (e.g. on a local NVMe), or leave disk_dir=None to run without a disk tier."
            ) from exc
        self.budget = budget if budget is not None else int(shutil.disk_usage(self.directory).free * free_fraction)
        self._finalizer = weakref.finalize(self, _remove_files, self._paths)

    @property
    def allocated_bytes(self) -> int:
        return sum(f.capacity * f.slot_bytes for f in self.files.values())

    @property
    def used_bytes(self) -> int:
        return sum(f.used * f.slot_bytes for f in self.files.values())

    @property
    def engine_name(self) -> str:
        first = next(iter(self.files.values()), None)
        return first.file.engine_name if first else "unopened"

    def slot_file(self, slot_bytes: int) -> DiskSlotFile:
        if slot_bytes not in self.files:
            try:
                slot_file = DiskSlotFile(self.directory, self._prefix, slot_bytes, self.engine)
            except OSError as exc:
                raise disk_error(exc, self.directory / f"{self._prefix}*.kv") from exc
            self._paths.append(slot_file.path)
            self.files[slot_bytes] = slot_file
        return self.files[slot_bytes]

    def alloc(self, slot_bytes: int, near: tuple[int, int] | None = None) -> int | None:
        """A free slot (beside its sequence neighbours where it can, so a layer's blocks read back as runs)."""
        slot_file = self.slot_file(slot_bytes)
        slot = slot_file.alloc(near)
        if slot is not None:
            return slot
        extent = growth_slots(self.budget, self.allocated_bytes, slot_bytes, self.extent_bytes)
        if extent:
            try:
                slot_file.grow(extent)
            except DiskFullError:
                if extent == 1:
                    raise
                slot_file.grow(1)  # the filesystem is nearly full: use what is left, one slot at a time
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            slot = slot_file.alloc(near)
        if slot is None and slot_file.reclaim():  # only runs' reserved slots are left: give them out
            slot = slot_file.alloc(near)
        return slot

    def free(self, slot_bytes: int, slot: int) -> None:
        self.files[slot_bytes].free(slot)

    # ------------------------------------------------------------------------------------------ I/O
    def write(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray) -> IOHandle:
        """Write ``buffer`` (``len(slots) * slot_bytes`` aligned bytes) to ``slots``, coalescing runs."""
        return self._submit(slot_bytes, slots, buffer, write=True)

    def read(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray) -> IOHandle:
        """Read ``slots`` into ``buffer`` in order, coalescing runs of consecutive slots into one request."""
        return self._submit(slot_bytes, slots, buffer, write=False)

    def start_read(self, layout: BlockLayout, slots: np.ndarray, scratch: Scratch, memo: dict | None = None,
                   purpose: str = "read") -> _DiskRead:
        slot_bytes = layout.slot_bytes
        owner = scratch.bounce_buffer(purpose)
        bounce = owner.get(len(slots) * slot_bytes)  # waits until the GPU has copied its last contents out
        try:
            handle = self.read(slot_bytes, slots, bounce)
        except OSError as exc:
            raise disk_error(exc, self.files[slot_bytes].path) from exc
        return _DiskRead(self, layout, bounce, handle, scratch, owner)

    def write_from(self, layout: BlockLayout, slots: np.ndarray, src: torch.Tensor, scratch: Scratch) -> None:
        """Stage ``src`` in the write bounce buffer and write it with one batched engine call."""
        slot_bytes = layout.slot_bytes
        bounce = scratch.bounce(len(slots) * slot_bytes, "write")
        staged = torch.from_numpy(bounce).view(len(slots), slot_bytes)
        layout.blocks_of(staged).copy_(src)
        try:
            handle = self.write(slot_bytes, slots, bounce)
        except OSError as exc:
            raise disk_error(exc, self.files[slot_bytes].path) from exc
        self.wait(handle, slot_bytes)

    def wait(self, handle: IOHandle, slot_bytes: int) -> None:
        """Wait for ``handle``; an OS failure becomes a :class:`DiskTierError` that names the file."""
        try:
            handle.wait()
        except TierKVError:
            raise
        except OSError as exc:
            raise disk_error(exc, self.files[slot_bytes].path) from exc

    def _submit(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray, write: bool) -> IOHandle:
        """One request per run of consecutive slots (found with numpy: the loop is over runs, not blocks)."""
        slot_file = self.files[slot_bytes]
        order = np.asarray(slots, dtype=np.int64)
        if order.size == 0:
            return slot_file.file.submit_writes([]) if write else slot_file.file.submit_reads([])
        cuts = (np.flatnonzero(np.diff(order) != 1) + 1).tolist()
        requests = [(slot_file.offset(int(order[a])), buffer[a * slot_bytes : b * slot_bytes])
                    for a, b in zip([0, *cuts], [*cuts, order.size])]
        submit = slot_file.file.submit_writes if write else slot_file.file.submit_reads
        return submit(requests)

    def close(self) -> None:
        try:
            for slot_file in self.files.values():
                slot_file.close()
        finally:
            self.files.clear()
            self._finalizer()


class _DiskRead:
    """A submitted read of a layer's disk blocks, in plan order, into a bounce buffer."""

    def __init__(self, tier: DiskTier, layout: BlockLayout, bounce: np.ndarray, handle: IOHandle,
                 scratch: Scratch, owner: BounceLike) -> None:
        self.tier, self.layout, self.bounce, self.handle, self.scratch = tier, layout, bounce, handle, scratch
        self.owner = owner

    def settle(self) -> None:
        with contextlib.suppress(OSError):  # the failure that matters was raised where it happened
            self.handle.wait()

    def finish(self, dests: Sequence[Dest]) -> None:
        layout = self.layout
        self.tier.wait(self.handle, layout.slot_bytes)
        staged = torch.from_numpy(self.bounce).view(-1, layout.slot_bytes)
        landing = self.scratch.landing()  # the finishing thread's (a read ahead is submitted on another)
        if landing is not None and dests and landing.device != dests[0][2].device:
            landing = None  # a read into host memory: straight from the bounce buffer
        for lo, hi, out in dests:
            if landing is None:
                out.copy_(layout.blocks_of(staged[lo:hi]), non_blocking=True)
                continue
            for piece, end, rows in landing_pieces(landing, layout.slot_bytes, lo, hi):
                rows.copy_(staged[piece:end], non_blocking=True)
                out[piece - lo : end - lo].copy_(layout.blocks_of(rows), non_blocking=True)
        if (landing is not None and landing.is_cuda) or any(out.is_cuda for _, _, out in dests):
            # the copies out of the bounce buffer are queued on this thread's stream: the next read into it
            # waits for them (on the host, only then), instead of every read syncing the stream now
            event = torch.cuda.Event()
            event.record()
            self.owner.fence(event)


def disk_error(exc: OSError, path: Path) -> DiskTierError:
    """Wrap an I/O failure of the disk tier in a TierKVError that says what to do."""
    if exc.errno == errno.ENOSPC:
        return DiskFullError(
            errno.ENOSPC, f"the disk tier ran out of space in {str(path.parent)!r}; free space there, point disk_dir "
            "at a larger filesystem, or lower disk_gb so the cache stops before the disk is full."
        )
    return DiskTierError(exc.errno, f"disk tier I/O failed on {str(path)!r}: {exc.strerror or exc}")


class BounceBuffer:
    """A reusable, aligned host buffer that grows geometrically (disk I/O needs aligned memory).

    With ``pin`` (CUDA hosts) the pages are registered with the driver (``cudaHostRegister``), so copies
    between it and the GPU are DMA at full PCIe speed instead of staged through pageable memory. The
    registration is undone when the buffer grows or is garbage-collected.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buffer = aligned_empty(0)
        self._finalizer: weakref.finalize | None = None
        self._fence: torch.cuda.Event | None = None  # GPU copies still reading the buffer (CUDA hosts)

    def fence(self, event: torch.cuda.Event) -> None:
        """Copies recorded before ``event`` still read the buffer: :meth:`get` waits for them."""
        self._fence = event

    def get(self, nbytes: int) -> np.ndarray:
        if self._fence is not None:
            self._fence.synchronize()
            self._fence = None
        if self._buffer.nbytes < nbytes:
            self.release()
            self._buffer = aligned_empty(max(nbytes, 2 * self._buffer.nbytes))
            if self.pin:
                address = self._buffer.ctypes.data
                _check_cuda(torch.cuda.cudart().cudaHostRegister(address, self._buffer.nbytes, 0))
                self._finalizer = weakref.finalize(self, _unregister, address)
        return self._buffer[:nbytes]

    def release(self) -> None:
        """Unpin and drop the buffer (the next :meth:`get` allocates anew)."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._buffer = aligned_empty(0)


def _unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _check_cuda(status: object) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise DiskTierError(0, f"cudaHostRegister of the disk bounce buffer failed (CUDA error {code}).")
