"""The disk tier: one preallocated file per slot size, slots at aligned offsets, I/O through tierkv.io.

The file grows in extents reserved with ``posix_fallocate`` (so a full filesystem fails early, at growth,
with ENOSPC — never halfway through a block write) up to the tier's budget. Files are deleted on
:meth:`DiskTier.close` and, as a safety net, at interpreter exit.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tierkv.errors import DiskFullError, DiskTierError
from tierkv.io import DiskFile, IOHandle, aligned_empty, open_disk_file
from tierkv.tiers.slots import SlotPool, growth_slots

DEFAULT_EXTENT_BYTES = 256 * 2**20


def _remove_files(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


class DiskSlotFile(SlotPool):
    """Slots of ``slot_bytes`` in one file, opened through a disk engine."""

    def __init__(self, path: Path, slot_bytes: int, engine: str | None) -> None:
        super().__init__()
        self.path = path
        self.slot_bytes = slot_bytes
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.file: DiskFile = open_disk_file(path, engine=engine)

    def grow(self, slots: int) -> None:
        try:
            os.posix_fallocate(self._fd, 0, (self.capacity + slots) * self.slot_bytes)
        except OSError as exc:
            raise disk_error(exc, self.path) from exc
        self.slots.grow(slots)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def close(self) -> None:
        self.file.close()
        os.close(self._fd)


class DiskTier:
    """Block slots on disk under ``directory``, at most ``budget`` bytes of files."""

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
            path = Path(tempfile.mktemp(dir=self.directory, prefix=self._prefix, suffix=f"-{slot_bytes}.kv"))
            self._paths.append(path)
            self.files[slot_bytes] = DiskSlotFile(path, slot_bytes, self.engine)
        return self.files[slot_bytes]

    def alloc(self, slot_bytes: int) -> int | None:
        slot_file = self.slot_file(slot_bytes)
        slot = slot_file.alloc()
        if slot is not None:
            return slot
        extent = growth_slots(self.budget, self.allocated_bytes, slot_bytes, self.extent_bytes)
        if extent == 0:
            return None
        try:
            slot_file.grow(extent)
        except DiskFullError:
            if extent == 1:
                raise
            slot_file.grow(1)  # the filesystem is nearly full: use what is left, one slot at a time
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return slot_file.alloc()

    def free(self, slot_bytes: int, slot: int) -> None:
        self.files[slot_bytes].free(slot)

    def write(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray) -> IOHandle:
        """Write ``buffer`` (``len(slots) * slot_bytes`` aligned bytes) to ``slots``, coalescing runs."""
        return self._submit(slot_bytes, slots, buffer, write=True)

    def read(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray) -> IOHandle:
        """Read ``slots`` into ``buffer`` in order, coalescing runs of consecutive slots into one request."""
        return self._submit(slot_bytes, slots, buffer, write=False)

    def _submit(self, slot_bytes: int, slots: Sequence[int], buffer: np.ndarray, write: bool) -> IOHandle:
        slot_file = self.files[slot_bytes]
        requests = []
        start = 0
        while start < len(slots):
            end = start + 1
            while end < len(slots) and slots[end] == slots[end - 1] + 1:
                end += 1
            requests.append((slot_file.offset(slots[start]), buffer[start * slot_bytes : end * slot_bytes]))
            start = end
        submit = slot_file.file.submit_writes if write else slot_file.file.submit_reads
        return submit(requests)

    def close(self) -> None:
        for slot_file in self.files.values():
            slot_file.close()
        self.files.clear()
        self._finalizer()


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
    between it and the GPU are DMA at full PCIe speed instead of staged through pageable memory.
    """

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._buffer = aligned_empty(0)

    def get(self, nbytes: int) -> np.ndarray:
        if self._buffer.nbytes < nbytes:
            self._unpin()
            self._buffer = aligned_empty(max(nbytes, 2 * self._buffer.nbytes))
            if self.pin:
                _check_cuda(torch.cuda.cudart().cudaHostRegister(self._buffer.ctypes.data, self._buffer.nbytes, 0))
        return self._buffer[:nbytes]

    def _unpin(self) -> None:
        if self.pin and self._buffer.nbytes:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.ctypes.data)


def _check_cuda(status: object) -> None:
    code = getattr(status, "value", status)
    if code != 0:
        raise DiskTierError(0, f"cudaHostRegister of the disk bounce buffer failed (CUDA error {code}).")
