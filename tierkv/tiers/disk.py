"""The disk tier: one preallocated file per slot size, slots at aligned offsets, I/O through tierkv.io.

The file grows in extents reserved with ``posix_fallocate`` (so a full filesystem fails early, at growth,
with ENOSPC — never halfway through a block write) up to the tier's budget: from :data:`FIRST_EXTENT_BYTES`,
doubling up to ``extent_bytes`` at a time, so a small KV takes a small file.

**Trust.** The files are created ``O_EXCL`` under random names at mode 0600 in the directory's descriptor and
opened once by the engine from the descriptor they were created through (``/proc/self/fd``, checked to be the same
file), never by name: a file another user renames into place is never opened, and the hot path adds no system
call. A ``disk_dir`` in which another user could rename the files (theirs, or one their group or everyone can
write without the sticky bit) is refused (:mod:`tierkv.safefs`).

**Integrity.** Every block written carries an xxh3-64 checksum of its slot's bytes, kept in memory beside
the slot (one ``uint64`` per slot); every read verifies each block after it landed in the bounce buffer and
before it is copied on, so a byte changed on disk (a failing drive, another program writing the file) raises
:class:`~tierkv.errors.IntegrityError` naming the file and slot, and wrong KV is never returned. Page reads
(:mod:`tierkv.store.pages`), which read a few 4 KiB sectors of a slot, verify each against an xxh3-64 per sector
taken at the same write (:data:`SECTOR_BYTES`).

**Lifetimes.** The tier holds a :class:`~tierkv.tiers.lease.Lease` (a ``flock``-ed lock file) on its files;
when it opens a directory it first removes the files of tiers whose process died. Its files are closed and
removed by :meth:`DiskTier.close`, or by a finalizer when the tier is garbage-collected or the interpreter
exits; a removal that fails is logged and retried at exit, and never raises.

**Memory.** A read of a layer's disk blocks is one batched engine call into an aligned bounce buffer
(adjacent slots coalesce into one request); it is submitted in :meth:`DiskTier.start_read` and runs on the
engine's own threads while the caller copies the layer's memory blocks, then lands in the destination. No
I/O bounces through more than :attr:`DiskTier.bounce_bytes` (:data:`BOUNCE_BYTES`, less at small budgets): a
larger read runs in rounds through two halves of the buffer (the next round in flight while the last is
verified and copied out), a larger write in rounds. Split attention's reads ring through smaller pieces of three
such buffers each (all pieces but one in flight while one is attended), two reads at once instead of six, so
they hold the same ``READ_AHEAD + 2`` read-ahead buffers as exact gather's (:mod:`tierkv.attention.split`, "Memory
and queue depth").
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import shutil
import stat
import weakref
from collections.abc import Collection, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv import forks, safefs, settings
from tierkv.accel import DEVICE, HOST_ONLY, HostOnly
from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Tier
from tierkv.errors import DiskFullError, DiskTierError, IntegrityError, InvalidConfigError, TierKVError
from tierkv.io import ALIGN, DiskFile, IOHandle, aligned_empty, open_disk_file
from tierkv.io.base import ArrayPlan, EndOfFileError, open_fd
from tierkv.io.checksum import xxh3_rows
from tierkv.io.native import NativeFile, RingPlan, RoundsOutcome
from tierkv.layout import BlockLayout, SlotBytes
from tierkv.tiers.base import BounceLike, Dest, Scratch, landing_pieces
from tierkv.tiers.lease import Lease, reclaim_dead
from tierkv.tiers.slots import SlotPool, growth_slots
from tierkv.units import format_bytes

log = logging.getLogger("tierkv")

DEFAULT_EXTENT_BYTES = 256 * 2**20
LOW_DEFAULT_BUDGET = 64 * 2**20  # a default budget below this (a disk_dir nearly full) is warned of when made
FIRST_EXTENT_BYTES = 2**20
"""A slot file starts with this much (or one slot) and doubles, up to ``extent_bytes`` at a time: it grows with
the KV it holds, never past the budget."""
BOUNCE_BYTES = 32 * 2**20
"""The most host memory one disk read or write bounces through (or two slots, for slots above half of it),
at large budgets. A read of more runs in rounds of half of it (four 4 MiB engine pieces), the next round in
flight while the last is copied out; a write of more runs in rounds of all of it. So the bounce buffers are
bounded independently of the context; at small budgets they shrink with them (:func:`bounce_bytes_for`):
see docs/reliability.md ("Memory"). (Split attention's reads ring through three such buffers each, two reads at
once instead of six: the same buffers, :data:`tierkv.attention.base.READ_AHEAD_BYTES`.)"""
MIN_BOUNCE_BYTES = 2 * 2**20  # below this a layer's read at tiny budgets runs in rounds too small for the disk
BOUNCE_SHARE = 48
"""A bounce buffer holds at most 1/48 of the host memory the budgets give the cache: the buffers that may exist at
once stay within a quarter of the budgets (measured: tests/test_security.py's RSS test), and reach
:data:`BOUNCE_BYTES` at 1.5 GiB of budgets. Smaller buffers read the disk in more, smaller rounds: at ~200 MB of
budgets a step mostly on disk is ~1.8x its disk bound instead of ~1.2x (docs/benchmarks.md, "Scale")."""


def bounce_bytes_for(memory_budget: int) -> int:
    """The bounce limit for budgets of ``memory_budget`` bytes of host memory: 1/:data:`BOUNCE_SHARE` of it,
    between :data:`MIN_BOUNCE_BYTES` and :data:`BOUNCE_BYTES`."""
    return int(min(BOUNCE_BYTES, max(MIN_BOUNCE_BYTES, memory_budget // BOUNCE_SHARE)))

_LEFT_OVER: list[Path] = []  # files a close could not remove: retried at exit
os.register_at_fork(after_in_child=_LEFT_OVER.clear)  # the parent's to retry, not a forked child's

SECTOR_BYTES = ALIGN
"""The unit of page reads (:mod:`tierkv.store.pages`): each written slot also keeps an xxh3-64 per sector of this
many bytes (8 bytes per 4 KiB: 0.2% of the file in memory), so a read of a few sectors is verified on its own."""
_ADVICE = ("The drive returned wrong data or another program wrote to the file: check the drive (e.g. smartctl), keep "
           "disk_dir private, then call cache.reset() (or create a new cache) and run the prompt again.")


def checksums(rows: np.ndarray) -> np.ndarray:
    """xxh3-64 of each row of ``rows`` ``[n, slot_bytes]`` uint8, as ``[n]`` uint64 (one native call)."""
    return xxh3_rows(rows)


_SUM_MODULUS = 65521  # the largest prime below 2**16 (Adler-32's): position weights 1 .. 65521
_SUM_GROUP_BYTES = 4 * 2**20  # rows summed at a time: the int64 temporaries stay at 8x this


def positional_sums(rows: torch.Tensor) -> torch.Tensor:
    """``[n, 2]`` int64 per row of ``rows`` ``[n, slot_bytes]`` uint8 (even ``slot_bytes``), on the rows' device:
    ``(sum u_i, sum u_i * (i mod 65521 + 1))`` over the row's 16-bit words ``u_i``.

    The checksum that reads into GPU memory verify on the GPU (there is no xxh3 kernel to run there). Exact
    integer sums (each product is below 2**32, a sum below 2**63 for rows under 4 GiB), so the value is the same
    on every device and in every summation order. It catches any change of one word (the plain sum moves) and
    of two words unless they are a multiple of 65521 words apart and change by opposite amounts: weaker than
    xxh3-64, but it catches what a drive or another writer does (flipped bits, zeroed or stale sectors, torn
    writes) — see docs/reliability.md.
    """
    words_per_row = rows.shape[1] // 2
    weights = torch.arange(words_per_row, device=rows.device, dtype=torch.int64) % _SUM_MODULUS + 1
    out = torch.empty(rows.shape[0], 2, dtype=torch.int64, device=rows.device)
    step = max(1, _SUM_GROUP_BYTES // max(rows.shape[1], 1))
    for lo in range(0, rows.shape[0], step):  # groups of >= 4 MiB of rows, not a loop over blocks
        words = rows[lo : lo + step].view(torch.int16).to(torch.int64).bitwise_and_(0xFFFF)  # [g, W]
        out[lo : lo + step, 0] = words.sum(dim=1)
        out[lo : lo + step, 1] = words.mul_(weights).sum(dim=1)
    return out


def _remove(directory: int, path: Path) -> None:
    """Delete ``path`` (a regular file of this user in the directory ``directory``, a descriptor); on failure
    log it and retry at exit (cleanup never raises)."""
    try:
        safefs.remove_regular(directory, path.name)
    except OSError as exc:
        log.warning("tierkv: could not remove the disk tier file %s (%s); retrying at exit", path,
                    exc.strerror or exc)
        _LEFT_OVER.append(path)


@atexit.register
def _remove_left_over() -> None:
    for path in _LEFT_OVER:
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):  # never a link put in its place
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("tierkv: %s is left behind (%s); the next cache opening its directory removes it", path,
                        exc.strerror or exc)
    _LEFT_OVER.clear()


def _release(files: dict[int, DiskSlotFile], lease: Lease, directory: int) -> None:
    """Close and remove every file of a tier, then drop its lease and close its directory. Never raises: each
    failure is logged."""
    for slot_file in list(files.values()):
        forks.forget(slot_file.private)  # before the file goes: its inode may be another file's next
        try:
            slot_file.file.close()
            os.close(slot_file.fd)
        except Exception as exc:  # noqa: BLE001 - cleanup goes on; the file is still removed
            log.warning("tierkv: closing %s failed (%s)", slot_file.path, exc)
        _remove(directory, slot_file.path)
    files.clear()
    try:
        lease.release()
    except Exception as exc:  # noqa: BLE001
        log.warning("tierkv: releasing the lock file %s failed (%s)", lease.path, exc)
    os.close(directory)


class DiskSlotFile(SlotPool):
    """Slots of ``slot_bytes`` in one file, opened through a disk engine, with a checksum per written slot and one
    per 4 KiB sector of it (for page reads)."""

    def __init__(self, directory: int, where: Path, prefix: str, slot_bytes: int, engine: str | None) -> None:
        """A new file (``O_EXCL``, mode 0600) in the directory ``directory`` (a descriptor; ``where`` names it),
        kept open (``fd``, for growth) beside the engine's descriptor, opened once from ``fd`` (never by name)."""
        super().__init__()
        self.slot_bytes = slot_bytes
        self.fd, name = safefs.create_file(directory, f"{prefix}-", f"-{slot_bytes}.kv", shared=False)
        self.path = safefs.CreatedPath.of(where / name, self.fd)
        try:
            self.file: DiskFile = open_disk_file(self.path, engine=engine)
        except BaseException:
            os.close(self.fd)
            safefs.remove_regular(directory, name)
            raise
        self.private = forks.private_file(self.fd)  # a forked child closes its copies (the engine's too: same file)
        self.sums = np.zeros(0, dtype=np.uint64)  # [capacity]: xxh3-64 of what was written to each slot
        self.written = np.zeros(0, dtype=bool)  # [capacity]: the slot holds a block (its checksum is valid)
        # an engine that reads into GPU memory (kvikio with GDS) is verified there: [capacity, 2] positional sums
        self.device_reads = bool(getattr(self.file, "reads_device_memory", False))
        self.device_sums = np.zeros((0, 2), dtype=np.int64)
        self.sectors_per_slot = slot_bytes // SECTOR_BYTES
        self.sector_sums = np.zeros(0, dtype=np.uint64)  # [capacity * sectors_per_slot]: xxh3-64 of each sector

    def grow(self, slots: int) -> None:
        try:
            os.posix_fallocate(self.fd, 0, (self.capacity + slots) * self.slot_bytes)
        except OSError as exc:
            raise disk_error(exc, self.path) from exc
        sums = np.concatenate([self.sums, np.zeros(slots, dtype=np.uint64)])
        written = np.concatenate([self.written, np.zeros(slots, dtype=bool)])
        device_sums = (np.concatenate([self.device_sums, np.zeros((slots, 2), dtype=np.int64)]) if self.device_reads
                       else self.device_sums)
        sector_sums = np.concatenate([self.sector_sums, np.zeros(slots * self.sectors_per_slot, dtype=np.uint64)])
        with deferred_interrupts():  # slot ids and their checksum arrays grow together
            self.slots.grow(slots)
            self.sums, self.written, self.device_sums = sums, written, device_sums
            self.sector_sums = sector_sums

    def free(self, slot: int) -> None:
        super().free(slot)
        self.written[slot] = False

    def free_all(self) -> None:
        super().free_all()
        self.written[:] = False

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def record(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """``rows`` ``[n, slot_bytes]`` are being written to ``slots``: keep their checksums (one per slot, and one
        per sector for page reads)."""
        self.sums[slots] = checksums(rows)
        sectors = (slots[:, None] * self.sectors_per_slot + np.arange(self.sectors_per_slot)).ravel()
        self.sector_sums[sectors] = checksums(np.ascontiguousarray(rows).reshape(-1, SECTOR_BYTES))
        if self.device_reads:
            self.device_sums[slots] = positional_sums(torch.from_numpy(rows)).numpy()
        self.written[slots] = True

    def verify(self, slots: np.ndarray, digests: np.ndarray) -> None:
        """Raise :class:`IntegrityError` unless ``digests`` (xxh3-64 of the bytes read from ``slots``, as they
        landed) are those of what was written there."""
        self._refuse(slots, np.flatnonzero((digests != self.sums[slots]) | ~self.written[slots]))

    def verify_device(self, slots: np.ndarray, rows: torch.Tensor) -> None:
        """:meth:`verify` for ``rows`` ``[n, slot_bytes]`` that landed in GPU memory: their positional sums,
        computed where they are (only ``[n, 2]`` integers cross to the host)."""
        sums = positional_sums(rows).cpu().numpy()
        self._refuse(slots, np.flatnonzero((sums != self.device_sums[slots]).any(axis=1) | ~self.written[slots]))

    def _refuse(self, slots: np.ndarray, bad: np.ndarray) -> None:
        """Raise :class:`IntegrityError` for the first of the ``bad`` positions of ``slots`` (none: return)."""
        if bad.size == 0:
            return
        slot = int(slots[bad[0]])
        raise IntegrityError(
            errno.EIO, f"disk tier block checksum mismatch in {str(self.path)!r}: slot {slot} (bytes "
            f"{self.offset(slot)}..{self.offset(slot) + self.slot_bytes}) {self._damage(slot)}; {bad.size} of the "
            f"{len(slots)} blocks of this read differ. Nothing was returned from them. {_ADVICE}"
        )

    def verify_sectors(self, sectors: np.ndarray, digests: np.ndarray) -> None:
        """Raise :class:`IntegrityError` unless ``digests`` (xxh3-64 of the bytes read from the file's sectors
        ``sectors``, numbered from the start of the file in :data:`SECTOR_BYTES`) are those written there."""
        slots = sectors // self.sectors_per_slot
        bad = np.flatnonzero((digests != self.sector_sums[sectors]) | ~self.written[slots])
        if bad.size == 0:
            return
        sector, slot = int(sectors[bad[0]]), int(slots[bad[0]])
        raise IntegrityError(
            errno.EIO, f"disk tier sector checksum mismatch in {str(self.path)!r}: slot {slot} (bytes "
            f"{sector * SECTOR_BYTES}..{(sector + 1) * SECTOR_BYTES} of the file, sector "
            f"{sector - slot * self.sectors_per_slot} of the slot) {self._damage(slot)}; {bad.size} of the "
            f"{len(sectors)} sectors of this page read differ. Nothing was returned from them. {_ADVICE}"
        )

    def _damage(self, slot: int) -> str:
        """What is wrong with ``slot``, whose checksum did not match."""
        return ("was never written (a bug in tierkv: please report it)" if not self.written[slot] else
                "does not hold the bytes written to it")


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
        self.bounce_bytes = BOUNCE_BYTES
        """The most one read or write bounces through (:meth:`fit_bounce` shrinks it for small budgets)."""
        self._fd = -1
        try:
            with deferred_interrupts():  # the descriptor is recorded (closed on failure) as it is made
                self._fd = safefs.open_user_directory(self.directory)
            reclaim_dead(self._fd, self.directory)
            with deferred_interrupts():  # the lease is recorded (released by the finalizer) as it is made
                self._lease = Lease(self._fd, self.directory)  # also proves that the directory takes new files
        except BaseException as exc:  # whatever fails, the directory's descriptor is closed
            if self._fd >= 0:
                os.close(self._fd)
            if isinstance(exc, DiskTierError) or not isinstance(exc, OSError):
                raise
            if exc.errno == errno.ENOSPC and _no_inodes_left(self.directory):
                raise disk_error(exc, self.directory / "tierkv-*.lock") from exc
            limit = limit_advice(exc)
            if limit is not None:
                raise DiskTierError(exc.errno, f"disk_dir {str(self.directory)!r} could not be opened: {limit}") \
                    from exc
            raise DiskTierError(
                exc.errno, f"disk_dir {str(self.directory)!r} is not writable ({exc.strerror}); pass a directory you "
                "can write to (e.g. on a local NVMe), or leave disk_dir=None to run without a disk tier."
            ) from exc
        self._finalizer = forks.finalize(self, _release, self.files, self._lease, self._fd)
        try:
            self.budget = budget if budget is not None else self._default_budget(free_fraction)
            self._check_writes()
            self._check_direct_io()
        except BaseException:
            self._finalizer()
            raise
        if budget is None and self.budget < LOW_DEFAULT_BUDGET:  # it would fail only once the KV reaches the disk
            log.warning("tierkv: disk_dir %r has %s free, so the disk tier's default budget (%.0f%% of it) is %s: "
                        "free space there, choose another disk_dir, or pass disk_gb.", str(self.directory),
                        format_bytes(shutil.disk_usage(self.directory).free), 100 * free_fraction,
                        format_bytes(self.budget))  # fmt: skip

    def fit_bounce(self, memory_budget: int) -> None:
        """Size the bounce buffers for budgets of ``memory_budget`` bytes of host memory (the host tier's, and the
        device tier's when the device is the CPU): :func:`bounce_bytes_for`. Call before the first I/O."""
        self.bounce_bytes = bounce_bytes_for(memory_budget)

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

    def _default_budget(self, free_fraction: float) -> int:
        """``free_fraction`` of the free space under the directory; refused where the filesystem reports no size."""
        usage = shutil.disk_usage(self.directory)
        if usage.total == 0:
            raise InvalidConfigError(
                f"the filesystem under disk_dir {str(self.directory)!r} reports no size (ramfs, some FUSE and network "
                "filesystems), so the disk tier's budget cannot default to its free space: pass disk_gb.")
        return int(usage.free * free_fraction)

    def _check_writes(self) -> None:
        """Write a byte to a probe file now: a filesystem that makes files but refuses to write them (hugetlbfs:
        EINVAL) is refused when the cache is built, naming its type, not at its first spill in the middle of a
        forward. Any other failure (a full filesystem, no inode left) is left to the spill, whose error says why."""
        try:
            fd, name = safefs.create_file(self._fd, f"{self._lease.prefix}-probe-", ".kv", shared=False)
        except OSError:
            return
        try:
            os.pwrite(fd, b"\0", 0)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                from tierkv.calibrate.machine import filesystem_of  # only to word this error

                raise InvalidConfigError(
                    f"disk_dir {str(self.directory)!r} is on a filesystem that makes files but refuses to write "
                    f"them ({exc.strerror}; {filesystem_of(self.directory)}), such as hugetlbfs: put disk_dir on a "
                    "regular filesystem (ext4, xfs, tmpfs), or leave disk_dir=None to run without a disk tier."
                ) from exc
        finally:
            os.close(fd)
            safefs.remove_regular(self._fd, name)

    def _check_direct_io(self) -> None:
        """Where O_DIRECT is required (``TIERKV_DIRECT_IO=1``), open a 4 KiB probe file with it now and read it: a
        filesystem that refuses it (tmpfs before Linux 6.6, ramfs, many FUSE mounts) is refused when the cache is
        built, not at its first spill in the middle of a forward."""
        if settings.get("direct_io") is not True:
            return
        fd, name = safefs.create_file(self._fd, f"{self._lease.prefix}-probe-", ".kv", shared=False)
        try:
            with contextlib.suppress(OSError):  # (a full filesystem: the open is still tried)
                os.posix_fallocate(fd, 0, ALIGN)
            os.close(open_fd(safefs.CreatedPath.of(self.directory / name, fd), True)[0])
        except InvalidConfigError as exc:
            raise InvalidConfigError(
                f"disk_dir {str(self.directory)!r} is on a filesystem that refuses O_DIRECT, which TIERKV_DIRECT_IO=1 "
                "requires: put disk_dir on one that supports it (ext4, xfs), or unset TIERKV_DIRECT_IO (O_DIRECT "
                "where the filesystem takes it, else the page cache).") from exc
        finally:
            os.close(fd)
            safefs.remove_regular(self._fd, name)

    def slot_file(self, slot_bytes: int) -> DiskSlotFile:
        if slot_bytes not in self.files:
            if not self._finalizer.alive:
                raise DiskTierError(errno.EBADF, "the disk tier was closed; create a new cache.")
            try:
                slot_file = DiskSlotFile(self._fd, self.directory, self._lease.prefix, slot_bytes, self.engine)
            except TierKVError:
                raise
            except OSError as exc:
                raise self._directory_error(exc) from exc
            self.files[slot_bytes] = slot_file
        return self.files[slot_bytes]

    def _directory_error(self, exc: OSError) -> DiskTierError:
        """The first file in ``directory`` could not be created: say what happened to the directory."""
        where = str(self.directory)
        if exc.errno == errno.ENOENT:
            return DiskTierError(
                exc.errno, f"disk_dir {where!r} no longer exists (it was removed after the cache was created); "
                "recreate it and create a new cache (this one keeps using the directory it opened, so recreating it "
                "does not bring this cache's disk tier back), or create the cache with another disk_dir."
            )
        if exc.errno in UNWRITABLE_ERRNOS:
            return DiskTierError(exc.errno, f"disk_dir {where!r} no longer accepts new files ({exc.strerror}): "
                                            f"{made_unwritable('it')}")
        return disk_error(exc, self.directory / f"{self._lease.prefix}-*.kv")

    def alloc(self, slot_bytes: int, near: tuple[int, int] | None = None) -> int | None:
        """A free slot (beside its sequence neighbours where it can, so a layer's blocks read back as runs)."""
        slot_file = self.slot_file(slot_bytes)
        slot = slot_file.alloc(near)
        if slot is not None:
            return slot
        step = min(self.extent_bytes, max(FIRST_EXTENT_BYTES, slot_file.capacity * slot_bytes))  # doubles
        extent = growth_slots(self.budget, self.allocated_bytes, slot_bytes, step)
        if extent:
            try:
                slot_file.grow(extent)
            except DiskTierError as exc:
                if extent == 1 or not isinstance(exc, DiskFullError) and exc.errno != errno.EFBIG:
                    raise
                slot_file.grow(1)  # the filesystem (or the file's size limit) is nearly reached: one slot at a time
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            slot = slot_file.alloc(near)
        if slot is None and slot_file.reclaim():  # only runs' reserved slots are left: give them out
            slot = slot_file.alloc(near)
        return slot

    def free(self, slot_bytes: int, slot: int) -> None:
        self.files[slot_bytes].free(slot)

    def free_all(self) -> None:
        for slot_file in self.files.values():
            slot_file.free_all()

    def slot_counts(self) -> dict[int, int]:
        return {slot_bytes: slot_file.used for slot_bytes, slot_file in self.files.items()}

    def release_unheld(self, held: Mapping[int, Collection[int]]) -> int:
        return sum(file.release_unheld(held.get(slot_bytes, ())) for slot_bytes, file in self.files.items())

    # ------------------------------------------------------------------------------------------ I/O
    def write(self, slot_bytes: int, slots: Sequence[int] | np.ndarray, buffer: np.ndarray) -> IOHandle:
        """Write ``buffer`` (``len(slots) * slot_bytes`` aligned bytes) to ``slots``, coalescing runs, and keep
        each block's checksum for the reads that follow."""
        order = np.asarray(slots, dtype=np.int64)
        self.files[slot_bytes].record(order, buffer[: order.size * slot_bytes].reshape(order.size, slot_bytes))
        try:
            return self._submit(slot_bytes, order, buffer, write=True)
        except OSError as exc:
            raise disk_error(exc, self.files[slot_bytes].path) from exc

    def read(self, slot_bytes: int, slots: np.ndarray, buffer: np.ndarray | torch.Tensor,
             plan: ArrayPlan | None = None) -> tuple[IOHandle, np.ndarray | None]:
        """Submit a read of ``slots`` into ``buffer`` in order (a device tensor only for an engine that reads into
        device memory), coalescing runs of consecutive slots into one request — or, into a host buffer, as ``plan``
        (:meth:`plan_rounds`' for these slots) says, without working them out again. Also returns the xxh3-64 of
        each slot as it landed where the engine computes them on its I/O threads (native; valid once the handle was
        waited on), else None: the caller hashes the buffer. (The check against the written checksums is
        :meth:`start_read`'s.)"""
        slots = np.asarray(slots, dtype=np.int64)
        if isinstance(buffer, np.ndarray):  # a host buffer: the read as one round of its own, unless planned already
            plan = self.plan_rounds(slot_bytes, slots, max(1, slots.size))[0] if plan is None else plan
            return self.files[slot_bytes].file.submit_plan(plan, buffer)
        return self._device_read(slot_bytes, slots, buffer)

    def plan_rounds(self, slot_bytes: int, slots: np.ndarray, per_round: int) -> list[ArrayPlan]:
        """The hashed read of ``slots`` in rounds of ``per_round``, each round into a buffer of its own from its first
        byte: one checked plan per round (:class:`~tierkv.io.base.ArrayPlan`, a request per run of consecutive slots
        inside the round), found for all rounds at once with numpy and kept by the caller, so that a read repeated
        every step (:meth:`read` with the round's plan) costs no request arithmetic or checks per round."""
        slots = np.asarray(slots, dtype=np.int64)
        first, count = _runs(slots, per_round)
        cuts = np.searchsorted(first, np.arange(per_round, slots.size, per_round)).tolist()
        plan = self.files[slot_bytes].file.plan_array(slots[first] * slot_bytes, count * slot_bytes,
                                                      first % per_round * slot_bytes, write=False, unit=slot_bytes)
        return plan.split(cuts)

    def read_sectors(self, slot_bytes: int, sectors: np.ndarray,
                     buffer: np.ndarray) -> tuple[IOHandle, np.ndarray | None]:
        """Submit a read of the file's sectors ``sectors`` (sorted, unique, numbered from the start of the file in
        :data:`SECTOR_BYTES`) into ``buffer`` in order, consecutive sectors as one request: the one batched engine
        call of a page read. Also returns the xxh3-64 of each sector as it landed where the engine hashes on its
        I/O threads (native), else None (the caller hashes); the check is
        :meth:`DiskSlotFile.verify_sectors`. Host memory only: an engine that reads into GPU memory (kvikio with
        GDS) reads pages through this host bounce too."""
        slot_file = self.files[slot_bytes]
        first, count = _runs(np.asarray(sectors, dtype=np.int64))
        try:
            return slot_file.file.submit_array(sectors[first] * SECTOR_BYTES, count * SECTOR_BYTES, buffer,
                                               first * SECTOR_BYTES, write=False, unit=SECTOR_BYTES)
        except OSError as exc:
            raise disk_error(exc, slot_file.path, reading=True) from exc

    def start_read(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, scratch: Scratch, memo: dict | None = None,
                   purpose: str | Sequence[str] = "read", *, limit: int | None = None, parts: int = 2,
                   in_pieces: bool = False) -> _DiskRead:
        """Submit a read of ``slots`` into the scratch buffer ``purpose`` (or buffers: a ring through all of them):
        at most ``limit`` bytes of each (default :attr:`bounce_bytes`), a larger read (with ``in_pieces``, one larger
        than a piece) in rounds through a ring of ``parts`` pieces of each buffer (:class:`_DiskRead`; at least two
        pieces in all)."""
        slots = np.asarray(slots, dtype=np.int64)
        owners = [scratch.bounce_buffer(name) for name in ([purpose] if isinstance(purpose, str) else purpose)]
        return _DiskRead(self, self.files[layout.slot_bytes], layout, slots, owners, scratch, limit, parts, in_pieces,
                         memo)  # fmt: skip

    def write_from(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, src: torch.Tensor,
                   scratch: Scratch) -> None:
        """Stage ``src`` in the write bounce buffer and write it with one batched engine call per round of at
        most :attr:`bounce_bytes`."""
        slot_bytes = layout.slot_bytes
        per_round = max(1, self.bounce_bytes // slot_bytes)
        for lo in range(0, len(slots), per_round):
            hi = min(len(slots), lo + per_round)
            bounce = scratch.bounce_buffer("write").get((hi - lo) * slot_bytes, self.bounce_bytes)
            layout.blocks_of(torch.from_numpy(bounce).view(hi - lo, slot_bytes)).copy_(src[lo:hi])
            handle: IOHandle | None = None
            try:
                with deferred_interrupts():  # a Ctrl-C mid-submit must not lose the handle of queued writes
                    handle = self.write(slot_bytes, slots[lo:hi], bounce)
                self.wait(handle, slot_bytes, reading=False)
            except OSError as exc:
                raise disk_error(exc, self.files[slot_bytes].path) from exc
            except BaseException:
                if handle is not None:  # the caller frees these slots: no write of ours may land in them later
                    with contextlib.suppress(Exception):
                        handle.wait()
                raise

    def wait(self, handle: IOHandle, slot_bytes: int, reading: bool = True) -> None:
        """Wait for ``handle`` (a read's, unless ``reading`` is False); an OS failure becomes a
        :class:`DiskTierError` that names the file (:func:`disk_error`)."""
        try:
            handle.wait()
        except TierKVError:
            raise
        except OSError as exc:
            raise disk_error(exc, self.files[slot_bytes].path, reading) from exc

    def _submit(self, slot_bytes: int, slots: np.ndarray, buffer: np.ndarray | torch.Tensor, write: bool) -> Any:
        """One request per run of consecutive slots (found with numpy: the loop is over runs, not blocks)."""
        file = self.files[slot_bytes].file
        requests: list[tuple[int, np.ndarray | torch.Tensor]] = []
        if slots.size:
            cuts = (np.flatnonzero(np.diff(slots) != 1) + 1).tolist()
            requests = [(self.files[slot_bytes].offset(int(slots[a])), buffer[a * slot_bytes : b * slot_bytes])
                        for a, b in zip([0, *cuts], [*cuts, slots.size])]
        return file.submit_writes(requests) if write else file.submit_reads(requests)

    def _device_read(self, slot_bytes: int, slots: np.ndarray,
                     buffer: torch.Tensor) -> tuple[IOHandle, np.ndarray | None]:  # fmt: skip
        """A hashed read into device memory (kvikio with GDS): one request per run of consecutive slots, found with
        numpy, as a list of requests."""
        first, count = _runs(slots)
        requests = [(int(slots[a]) * slot_bytes, buffer[a * slot_bytes : (a + n) * slot_bytes])
                    for a, n in zip(first.tolist(), count.tolist())]
        return self.files[slot_bytes].file.submit_hashed_reads(requests, slot_bytes)

    def close(self) -> None:
        """Close and remove the files and drop the lease; idempotent, never raises (failures are logged)."""
        self._finalizer()


class _DiskRead:
    """A submitted read of a layer's disk blocks, in plan order, into a bounce buffer of at most ``limit`` bytes
    (default :attr:`DiskTier.bounce_bytes`): one batched engine call when they fit (the usual case), else rounds
    through a ring of ``parts`` pieces of the buffer (default two halves): the first rounds submitted at once, one
    into each piece, then each next round into the piece the consumer just left, so all pieces but one are in
    flight while it uses one. Split's reads (whose consumer attends each round in place) ring through the pieces of
    several bounce buffers (``owners``, each at most ``limit``: ``len(owners) * parts`` pieces, in turn), so more
    rounds are in flight — a deeper disk queue — while no buffer grows past ``limit``; with ``in_pieces`` a read
    that fits one piece is cut into pieces too, so its first round is used while the others land. Every block is
    verified against its checksum before it is used: :meth:`each_round` hands out each round in place, in the
    bounce buffer (split attention attends it there); :meth:`finish` copies the rounds on. The rounds' requests are
    planned once per ``memo`` (a dict that lives as long as ``slots``: a cached plan's), not per read."""

    def __init__(self, tier: DiskTier, slot_file: DiskSlotFile, layout: BlockLayout | SlotBytes, slots: np.ndarray,
                 owners: Sequence[BounceLike], scratch: Scratch, limit: int | None = None, parts: int = 2,
                 in_pieces: bool = False, memo: dict | None = None) -> None:
        self.tier, self.slot_file, self.layout, self.slots, self.owners = tier, slot_file, layout, slots, owners
        self.scratch, self.memo = scratch, memo
        self.limit = tier.bounce_bytes if limit is None else limit
        self.parts, self.in_pieces = parts, in_pieces
        self.handles: dict[int, IOHandle] = {}
        self.digests: dict[int, np.ndarray | None] = {}  # per round: the engine's xxh3-64 of each slot (or None)
        # kvikio with GDS reads into GPU memory: such a read waits for finish() to know it lands on the device
        self.device_direct = slot_file.device_reads and scratch.accel.streams and scratch.landing_bytes > 0
        self.rounds = 0
        if not self.device_direct:
            self._start_host()

    @property
    def halves(self) -> list[np.ndarray]:
        """The ring's pieces under their default name (two halves, unless more were asked for)."""
        return self.pieces

    def _start_host(self) -> None:
        """Allocate the ring's pieces (at most ``limit`` bytes of each owner's buffer, or two slots for slots above
        half of it; piece ``i`` in owner ``i % len(owners)``) and submit the first round into each."""
        slots, size, limit, owners = self.slots, self.layout.slot_bytes, self.limit, self.owners
        whole = len(slots) * size <= (limit // self.parts if self.in_pieces else limit)
        self.per_round = len(slots) if whole else max(1, limit // self.parts // size)
        self.rounds = -(-len(slots) // self.per_round) if len(slots) else 0
        memo, key = {} if self.memo is None else self.memo, ("rounds", self.per_round)
        if key not in memo:
            memo[key] = self.tier.plan_rounds(size, slots, self.per_round)
        self.plans: list[ArrayPlan] = memo[key]
        piece, n = self.per_round * size, len(owners)
        count = 1 if self.per_round >= len(slots) else min(self.rounds, max(2, n * min(self.parts, limit // piece)))
        # waits until the GPU copied its last out of each buffer, and until the reads into it landed
        buffers = [owner.get(len(range(j, count, n)) * piece, limit) for j, owner in enumerate(owners[:count])]
        self.pieces = [buffers[i % n][i // n * piece : (i // n + 1) * piece] for i in range(count)]
        self._piece_owners = [owners[i % n] for i in range(count)]
        self._copied: list[Any] = [None] * count  # events after the GPU copies still reading a piece
        for k in range(min(count, self.rounds)):
            self._submit(k)

    def _bounds(self, k: int) -> tuple[int, int]:
        return k * self.per_round, min(len(self.slots), (k + 1) * self.per_round)

    def _submit(self, k: int) -> None:
        lo, hi = self._bounds(k)
        piece = k % len(self.pieces)
        if self._copied[piece] is not None:
            self._copied[piece].synchronize()
            self._copied[piece] = None
        buffer = self.pieces[piece][: (hi - lo) * self.layout.slot_bytes]
        self.scratch.accel.host_write(torch.from_numpy(buffer))  # the engine fills it from now on
        try:
            with deferred_interrupts():  # a Ctrl-C mid-submit must not lose the handle of reads already queued:
                handle, self.digests[k] = self.tier.read(self.layout.slot_bytes, self.slots[lo:hi], buffer,
                                                         self.plans[k])  # fmt: skip
                self.handles[k] = handle
                self._piece_owners[piece].landing(handle)  # its next user waits for it, whatever happens to the read
        except OSError as exc:
            raise disk_error(exc, self.slot_file.path, reading=True) from exc

    def settle(self) -> None:
        """Wait for the rounds in flight (a barrier: the read stays usable; its failure is raised by finish)."""
        for handle in self.handles.values():
            with contextlib.suppress(OSError):
                handle.wait()

    def each_round(self) -> Generator[tuple[int, int, torch.Tensor], None, None]:
        """Each round in turn, verified, in place: ``(lo, hi, staged)``, slots ``[lo, hi)`` of the read as
        ``staged`` ``[hi - lo, slot_bytes]`` uint8 in the bounce buffer (``layout.blocks_of(staged)``: the blocks).

        The next ``parts - 1`` rounds are in flight into the other pieces meanwhile; a piece is read into again
        only once the consumer asked for the round after the one it held, so ``staged`` stays valid until then.
        Leaving early (an error, an interrupt, the generator closed) waits for the rounds in flight first: nothing
        lands in the buffer after that."""
        if self.device_direct:  # wanted in host memory after all (a demotion's copy, split's rounds): bounce it
            self.device_direct = False
            self._start_host()
        size = self.layout.slot_bytes
        try:
            ring = len(self.pieces) if self.rounds else 0
            for k in range(self.rounds):
                if k > 0 and k + ring - 1 < self.rounds:  # rounds 0 .. ring - 1 went at the start
                    self._submit(k + ring - 1)  # into the piece of round k - 1, which the consumer has left
                handle = self.handles[k]
                self.tier.wait(handle, size)
                del self.handles[k]
                lo, hi = self._bounds(k)
                staged = torch.from_numpy(self.pieces[k % ring][: (hi - lo) * size]).view(hi - lo, size)
                digests = self.digests.pop(k)  # of the bytes that landed, hashed by the engine's I/O threads
                self.slot_file.verify(self.slots[lo:hi], checksums(staged.numpy()) if digests is None else digests)
                yield lo, hi, staged
        except BaseException:
            self.settle()
            raise

    def ring_views(self) -> list[tuple[int, int, torch.Tensor]] | None:
        """Where each round will land, for :meth:`consume_rounds`: ``(lo, hi, staged)`` as :meth:`each_round` hands
        them out (``staged`` holds the round's bytes only while :meth:`consume_rounds` hands the round to its
        consumer). None where the rounds cannot be consumed in one C loop: another engine than the native one (which
        hashes as it reads), a read into device memory, a slot never written (:meth:`each_round` raises its error
        in turn), or a read whose rounds were handed out already (or whose handles are not the engine's own)."""
        file = self.slot_file.file
        if self.device_direct or not self.rounds or not isinstance(file, NativeFile) or \
                sorted(self.handles) != list(range(min(len(self.pieces), self.rounds))) or \
                not all(file.owns(handle) for handle in self.handles.values()) or \
                not self.slot_file.written[self.slots].all():  # fmt: skip
            return None
        size, ring = self.layout.slot_bytes, len(self.pieces)
        return [(lo, hi, torch.from_numpy(self.pieces[k % ring][: (hi - lo) * size]).view(hi - lo, size))
                for k in range(self.rounds) for lo, hi in [self._bounds(k)]]  # fmt: skip

    def consume_rounds(self, consumer: int, arguments: np.ndarray) -> RoundsOutcome:
        """Every round, in turn, verified, handed in place to the C function ``consumer`` (``int f(const char *)``)
        with ``arguments[k]`` (an address): :meth:`each_round`'s loop in one C call (:meth:`NativeFile.run_rounds`),
        no Python between rounds. Only where :meth:`ring_views` gave the rounds. Raises a round's I/O failure or
        checksum mismatch as :meth:`each_round` does; returns the consumer's refusal (the round and its status) and
        the time spent waiting for rounds. Nothing is in flight afterwards."""
        file, slots, ring = self.slot_file.file, self.slots, len(self.pieces)
        assert isinstance(file, NativeFile) and not self.device_direct, "consume_rounds: only after ring_views"
        memo, key = {} if self.memo is None else self.memo, ("ring", self.per_round)
        if key not in memo:
            memo[key] = RingPlan.of(self.plans)
        plan: RingPlan = memo[key]
        given = [self.handles[k] for k in sorted(self.handles)]
        landed = np.empty(int(plan.unit_start[-1] - plan.unit_start[len(given)]), dtype=np.uint64)
        digests: list[np.ndarray] = []
        for k in range(len(given)):
            array = self.digests[k]
            assert array is not None  # the native engine hashes as it reads
            digests.append(array)
        digests += [landed[plan.unit_start[k] - plan.unit_start[len(given)] :] for k in range(len(given), self.rounds)]
        for k in range(len(given), min(self.rounds, len(given) + ring)):  # the pieces the loop reads into again
            self.scratch.accel.host_write(torch.from_numpy(self.pieces[k % ring]))
        try:
            outcome = file.run_rounds(plan, self.pieces, given, digests, self.slot_file.sums[slots], consumer,
                                      arguments)  # fmt: skip
        except OSError as exc:
            raise disk_error(exc, self.slot_file.path, reading=True) from exc
        finally:
            self.settle()  # the given rounds landed (the loop waited for them): their batches are freed
            self.handles.clear()
            self.digests.clear()
        if outcome.failed is not None and not outcome.refused:
            lo, hi = self._bounds(outcome.failed)
            self.slot_file.verify(slots[lo:hi], digests[outcome.failed][: hi - lo])  # raises its IntegrityError
        return outcome

    def finish(self, dests: Sequence[Dest]) -> None:
        layout, size = self.layout, self.layout.slot_bytes
        accel = self.scratch.accel
        landing = self.scratch.landing()  # the finishing thread's (a read ahead is submitted on another)
        into_device = bool(dests) and accel.space(dests[0][2]) == DEVICE
        if self.device_direct and into_device and landing is not None:
            self._finish_on_device(dests, landing)
            return
        if not into_device:
            landing = None  # a read into host memory: straight from the bounce buffer
        cuda = into_device and accel.streams
        with contextlib.closing(self.each_round()) as rounds:
            for lo, hi, staged in rounds:
                for first, last, out in dests:
                    a, b = max(first, lo), min(last, hi)
                    if a >= b:
                        continue
                    if landing is None:
                        accel.copy(out[a - first : b - first], layout.blocks_of(staged[a - lo : b - lo]))
                        continue
                    for piece, end, rows in landing_pieces(landing, size, a, b):
                        accel.copy(rows, staged[piece - lo : end - lo])
                        accel.copy(out[piece - first : end - first], layout.blocks_of(rows))
                if cuda:
                    # the copies out of the bounce buffer are queued on this thread's stream: the next read into
                    # the piece waits for them (on the host, only then), instead of every read syncing the stream now
                    event = accel.Event()
                    event.record(accel.current_stream(dests[0][2].device))
                    self._copied[lo // self.per_round % len(self.pieces)] = event
                    self._piece_owners[lo // self.per_round % len(self.pieces)].fence(event)

    def _finish_on_device(self, dests: Sequence[Dest], landing: torch.Tensor) -> None:
        """GDS: the engine reads each landing-buffer's worth of slots straight into the device landing buffer
        (no host memory on the way), the positional sums are checked on the device, then one device copy per
        destination run. The landing buffer is written from outside the stream, so each piece first waits for
        the stream's earlier copies out of it."""
        layout, size, accel = self.layout, self.layout.slot_bytes, self.scratch.accel
        stream = accel.current_stream(dests[0][2].device)
        for piece, end, rows in landing_pieces(landing, size, 0, len(self.slots)):
            stream.synchronize()
            accel.host_write(rows)  # the engine writes it from outside the stream's order (the stand-in checks)
            flat = rows.reshape(-1)
            try:
                with deferred_interrupts():  # as in _submit: no Ctrl-C between queueing the reads and their handle
                    handle, _ = self.tier.read(size, self.slots[piece:end], flat if flat.is_cuda else flat.numpy())
            except OSError as exc:
                raise disk_error(exc, self.slot_file.path, reading=True) from exc
            try:
                self.tier.wait(handle, size)
            except BaseException:  # an interrupted wait: nothing may land in the landing buffer once it is reused
                with contextlib.suppress(Exception):
                    handle.wait()
                raise
            self.slot_file.verify_device(self.slots[piece:end], rows)
            for first, last, out in dests:
                a, b = max(first, piece), min(last, end)
                if a < b:
                    accel.copy(out[a - first : b - first], layout.blocks_of(rows[a - piece : b - piece]))


def _runs(items: np.ndarray, every: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The runs of consecutive integers in ``items`` ``[n]``: the position of each run's first and its length; with
    ``every``, a run also starts at every multiple of it (rounds of ``every`` items). (Plain ufuncs into
    preallocated arrays: ``np.diff`` with ``prepend``/``append`` costs ~3 us of Python each, on every page read.)"""
    starts = np.empty(items.size + 1, dtype=bool)
    starts[0] = starts[-1] = True  # a run starts at 0, and one "starts" past the end: its predecessor's end
    np.not_equal(items[1:], items[:-1] + 1, out=starts[1:-1])
    if every:
        starts[every : items.size : every] = True
    bounds = np.flatnonzero(starts)
    return bounds[:-1], bounds[1:] - bounds[:-1]


def _no_inodes_left(directory: Path) -> bool:
    """Whether the filesystem under ``directory`` has free blocks but no free inodes (an ENOSPC that a smaller
    disk_gb cannot help); False where it cannot tell."""
    try:
        fs = os.statvfs(directory)
    except OSError:
        return False
    return fs.f_files > 0 and fs.f_favail == 0 and fs.f_bavail > 0


UNWRITABLE_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS)
"""What a write into a file or directory made read-only or immutable (a read-only remount, ``chattr +i``) fails with."""


def made_unwritable(what: str) -> str:
    """Why ``what`` (disk_dir, or a file of the tier) refuses writes with one of :data:`UNWRITABLE_ERRNOS`, and
    what to do."""
    return (f"{what} was made read-only or immutable after the cache was created (a filesystem error remounts it "
            "read-only: the kernel log, dmesg, says why); make it writable again (a read-write mount, chattr -i, "
            "chmod u+w), or create the cache with another disk_dir.")


def disk_error(exc: OSError, path: Path, reading: bool = False) -> DiskTierError:
    """Wrap an I/O failure of the disk tier in a TierKVError that says what to do (``reading``: it failed reading
    blocks back, so those on disk may be lost, not writing new ones)."""
    if isinstance(exc, DiskTierError):
        return exc
    if exc.errno in UNWRITABLE_ERRNOS and not reading:
        return DiskTierError(exc.errno, f"disk tier I/O failed on {str(path)!r}: {exc.strerror or exc}: "
                                        f"{made_unwritable('the file or its filesystem')} The blocks accepted "
                                        "so far are intact.")
    if exc.errno == errno.ENOSPC and _no_inodes_left(path.parent):
        return DiskFullError(
            exc.errno, f"the disk tier could not create a file in {str(path.parent)!r}: the filesystem has space but "
            "no inodes left (df -i shows them); remove files there, or point disk_dir at another filesystem."
        )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "ran out of space" if exc.errno == errno.ENOSPC else "reached this user's disk quota"
        return DiskFullError(
            exc.errno, f"the disk tier {what} in {str(path.parent)!r}; free space there, point disk_dir at a larger "
            "filesystem, or lower disk_gb so the cache stops before the disk is full."
        )
    if isinstance(exc, EndOfFileError):
        return DiskTierError(
            exc.errno, f"disk tier I/O failed on {str(path)!r}: {exc.strerror}: the file is shorter than the blocks "
            "this cache wrote to it (another program truncated or replaced it), so the blocks past its end are lost; "
            "give each cache a disk_dir no other program writes to, and start the sequence again (cache.reset())."
        )
    if reading:
        return read_error(exc, path)
    limit = limit_advice(exc)
    if limit is not None:
        return DiskTierError(exc.errno, f"disk tier I/O failed on {str(path)!r}: {limit} The blocks accepted so far "
                                        "are intact.")
    return DiskTierError(
        exc.errno, f"disk tier I/O failed on {str(path)!r}: {exc.strerror or exc}. The blocks accepted so far are "
        "intact; check the drive and its kernel log (dmesg), or move disk_dir to another drive."
    )


def read_error(exc: OSError, path: Path) -> DiskTierError:
    """A read of blocks back from the disk tier failed (EIO: a failing drive, a filesystem error). What is known:
    nothing of that read was used (no KV from it is returned); whether the blocks on disk can still be read is
    not — a passing fault leaves them readable, a failing drive may not."""
    return DiskTierError(
        exc.errno, f"disk tier I/O failed on {str(path)!r} reading blocks back: {exc.strerror or exc}. Nothing of "
        "that read was used (no KV from it was returned), but whether the blocks on disk can still be read is "
        "unknown; check the drive and its kernel log (dmesg), then retry the step, or start the sequence "
        "again (cache.reset()) or create the cache with another disk_dir if it fails again."
    )


def limit_advice(exc: OSError, smaller: str = "lower disk_gb below it, or point disk_dir at another filesystem"
                 ) -> str | None:
    """What to do about ``exc`` where a limit of this process, not the drive, caused it (None: not one).
    ``smaller``: the ways besides raising the limit to write less than a file-size limit."""
    reason = exc.strerror or str(exc)
    if exc.errno == errno.EFBIG:
        return (f"{reason}: the largest file this process may write there (ulimit -f, or the filesystem's own "
                f"limit, e.g. FAT32's 4 GiB); raise the limit, or {smaller}.")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        whose = "this process" if exc.errno == errno.EMFILE else "the system"
        return (f"{reason}: {whose} has no file descriptor left; raise the limit (ulimit -n) or close files, "
                "then retry.")
    if exc.errno == errno.EAGAIN:
        return (f"{reason}: a thread, process or memory limit (ulimit -u or -v, a container's pids limit); raise "
                "it, or set TIERKV_IO_QUEUE_DEPTH lower, or TIERKV_DISK_ENGINE=posix.")
    return None


class BounceBuffer:
    """A reusable, aligned host buffer that grows geometrically up to its limit (disk I/O needs
    aligned memory).

    With ``pin`` (CUDA hosts) the pages are registered with the driver (``cudaHostRegister``) through
    ``accel`` (:mod:`tierkv.accel`), so copies between it and the GPU are DMA at full PCIe speed instead of
    staged through pageable memory. The registration is undone when the buffer grows, is released or is
    garbage-collected — each time only after the GPU copies still reading it (its fence) have run.
    """

    def __init__(self, pin: bool = False, accel: HostOnly = HOST_ONLY) -> None:
        self.pin = pin
        self.accel = accel
        self._buffer = aligned_empty(0)
        self._finalizer: weakref.finalize | None = None
        self._fence: list[Any] = [None]  # an event after the GPU copies still reading the buffer (CUDA hosts);
        # a cell, so the finalizer of a buffer that is garbage-collected waits for it too
        self._landing: list[IOHandle] = []  # reads submitted into the buffer that may not have landed yet

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes

    def fence(self, event: Any) -> None:
        """Copies recorded before ``event`` still read the buffer: :meth:`get` waits for them."""
        self._fence[0] = event

    def landing(self, handle: IOHandle) -> None:
        """A read submitted into the buffer: :meth:`get` and :meth:`release` wait until it landed, so a read
        abandoned by an interrupt (its owner never finished or settled it) cannot land in the next user's bytes."""
        self._landing = [h for h in self._landing if not h.done()]
        self._landing.append(handle)

    def get(self, nbytes: int, limit: int | None = None) -> np.ndarray:
        """The buffer's first ``nbytes``, for the caller to fill (a disk read or a staged write); it grows
        geometrically, but never past ``limit`` (default :data:`BOUNCE_BYTES`) unless ``nbytes`` is larger."""
        _wait_for(self._fence)
        self._settle()
        if self._buffer.nbytes < nbytes:
            grown = max(nbytes, min(2 * self._buffer.nbytes, BOUNCE_BYTES if limit is None else limit))
            self.release()
            self._buffer = aligned_empty(grown)
            address = self._buffer.ctypes.data
            self.accel.register_host(address, self._buffer.nbytes, self.pin)
            self._finalizer = forks.finalize(self, _unregister, self.accel, address, self.pin, self._fence)
        view = self._buffer[:nbytes]
        self.accel.host_write(torch.from_numpy(view))
        return view

    def release(self) -> None:
        """Unpin and drop the buffer (the next :meth:`get` allocates anew), once no GPU copy reads it and no
        read lands in it."""
        _wait_for(self._fence)
        self._settle()
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self._buffer = aligned_empty(0)

    def _settle(self) -> None:
        """Wait until every read submitted into the buffer landed (its failure is its reader's to report)."""
        while self._landing:
            with contextlib.suppress(Exception):
                self._landing[-1].wait()
            self._landing.pop()


def _wait_for(fence: list[Any]) -> None:
    if fence[0] is not None:
        fence[0].synchronize()
        fence[0] = None


def _unregister(accel: HostOnly, address: int, pin: bool, fence: list[Any]) -> None:
    _wait_for(fence)
    accel.unregister_host(address, pin)
