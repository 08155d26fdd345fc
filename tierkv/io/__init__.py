"""Disk I/O engines of the disk tier: kvikio (GPUDirect Storage), native (C thread pool), posix.

Everything the disk tier needs is re-exported here::

    from tierkv.io import ALIGN, aligned_empty, open_disk_file

    with open_disk_file(path) as f:                 # engine and O_DIRECT chosen and logged once
        handle = f.submit_reads([(0, buf_a), (1 << 20, buf_b)])
        ...                                         # overlap with compute
        handle.wait()                               # raises OSError with errno (ENOSPC, EIO ...)

Importing this package loads no engine: kvikio is imported and the native library loaded (built with the
package, else compiled on first use: ``native/README.md``) only when an engine is chosen, so it works with no
GPU, no kvikio and no compiler. Engine, O_DIRECT, queue depth and chunk size are settings
(:mod:`tierkv.settings`: ``TIERKV_DISK_ENGINE`` ... or a scoped override). See docs/disk-io.md.
"""

from tierkv.io.base import (
    ALIGN,
    AlignmentError,
    DiskFile,
    EngineUnavailableError,
    IOHandle,
    aligned_empty,
)
from tierkv.io.select import ENGINES, available_engines, engine_status, load_engine, open_disk_file

__all__ = [
    "ALIGN",
    "ENGINES",
    "AlignmentError",
    "DiskFile",
    "EngineUnavailableError",
    "IOHandle",
    "aligned_empty",
    "available_engines",
    "engine_status",
    "load_engine",
    "open_disk_file",
]
