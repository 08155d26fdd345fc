"""What a calibration run measures: transfer sizes, file and pool sizes, repeats (``tierkv bench`` flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.errors import InvalidConfigError
from tierkv.io import ALIGN

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure. :meth:`quick` is the ~10 s variant the tests run."""

    directory: Path  # where the disk files go: put it on the disk the disk tier will use
    min_size: int = 4 * KiB
    max_size: int = 1 * GiB
    disk_bytes: int = 1 * GiB
    block_bytes: int = 256 * KiB  # gather unit: one block of one layer
    engines: tuple[str, ...] | None = None  # None: every engine that loads here
    warmup: int = 1
    repeats: int = 5
    disk_point_bytes: int = 256 * MiB  # most bytes one disk point moves (small requests move less)
    contention_bytes: int = 64 * MiB  # bytes copied (and read by the compute) per contention sample
    gather_pool_bytes: int = 1 * GiB  # one layer's KV for the store gather: larger than a last-level cache

    def __post_init__(self) -> None:
        if not (ALIGN <= self.min_size <= self.max_size):
            raise InvalidConfigError(f"need {ALIGN} <= min_size <= max_size, got {self.min_size}, {self.max_size}.")
        if self.disk_bytes < self.min_size or self.disk_bytes % ALIGN:
            raise InvalidConfigError(f"disk size {self.disk_bytes} must be a multiple of {ALIGN} and >= min_size.")
        if self.block_bytes < ALIGN:  # the disk series read whole sectors of it
            raise InvalidConfigError(f"block_bytes={self.block_bytes} must be at least {ALIGN}.")
        if self.repeats < 1 or self.warmup < 0:
            raise InvalidConfigError("repeats must be >= 1 and warmup >= 0.")
        existing = next((p for p in (self.directory, *self.directory.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():  # said here, not as a FileExistsError from mkdir
            where = "is a file" if existing == self.directory else f"is inside {str(existing)!r}, a file"
            raise InvalidConfigError(
                f"bench directory {str(self.directory)!r} {where}, not a directory; give a directory on the "
                "disk to measure (it is created if missing)."
            )

    @classmethod
    def quick(cls, directory: Path, **overrides: Any) -> BenchConfig:
        """Small sizes and few repeats: checks the whole pipeline in seconds; numbers are indicative."""
        small = cls(directory, max_size=4 * MiB, disk_bytes=32 * MiB, block_bytes=64 * KiB, repeats=3,
                    disk_point_bytes=8 * MiB, contention_bytes=8 * MiB, gather_pool_bytes=32 * MiB)  # fmt: skip
        return dataclasses.replace(small, **overrides)


def transfer_sizes(min_size: int, max_size: int) -> list[int]:
    """Sizes from ``min_size`` to ``max_size`` in steps of 4x (4 KiB, 16 KiB ... 1 GiB)."""
    sizes, size = [], min_size
    while size <= max_size:
        sizes.append(size)
        size *= 4
    return sizes
