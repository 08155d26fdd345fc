"""Fixtures of the benchmark suites: one real data file, a CUDA skip, the environment knobs.

Run with ``pytest benchmarks --benchmark-enable`` (the default test run passes ``--benchmark-disable``).
Knobs: ``TIERKV_BENCH_DIR`` (where the disk file lives; put it on the disk you care about),
``TIERKV_BENCH_DISK_SIZE`` (default 1GiB), ``TIERKV_BENCH_REQUEST`` (disk request size, default 4MiB).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tierkv.inputs import env_str
from tierkv.io import aligned_empty, open_disk_file
from tierkv.units import parse_size


@pytest.fixture(scope="session")
def disk_size() -> int:
    return parse_size(env_str("TIERKV_BENCH_DISK_SIZE", "1GiB"), name="TIERKV_BENCH_DISK_SIZE")


@pytest.fixture(scope="session")
def request_size() -> int:
    return parse_size(env_str("TIERKV_BENCH_REQUEST", "4MiB"), name="TIERKV_BENCH_REQUEST")


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    """Where the benchmarks' disk files and disk tiers go (``TIERKV_BENCH_DIR``; default: the temp folder)."""
    return Path(env_str("TIERKV_BENCH_DIR", tempfile.gettempdir()))


@pytest.fixture(scope="session")
def data_file(disk_size: int, bench_dir: Path) -> Iterator[Path]:
    """A file of ``disk_size`` bytes of real data (a sparse file would read as zeros without disk I/O)."""
    path = bench_dir / f"tierkv-benchmark-{os.getpid()}.bin"
    with open(path, "wb") as f:
        f.truncate(disk_size)
    chunk = aligned_empty(min(disk_size, 64 << 20))
    chunk[:] = np.random.default_rng(0).integers(0, 256, chunk.nbytes, dtype=np.uint8)
    with open_disk_file(path, engine="posix") as f:
        f.submit_writes(
            [(off, chunk[: min(chunk.nbytes, disk_size - off)]) for off in range(0, disk_size, chunk.nbytes)]
        ).wait()
    os.sync()
    yield path
    path.unlink(missing_ok=True)
