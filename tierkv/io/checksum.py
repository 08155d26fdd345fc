"""xxh3-64 of every row of a block array, in one call: in C when the native library loads, else per row.

The disk tier keeps one xxh3-64 (seed 0) per written slot and verifies each block it reads back. A decode
step reads hundreds of blocks, so hashing them one Python call at a time is a loop over blocks on the hot
path; :func:`xxh3_rows` hashes all rows of ``[n, row_bytes]`` in one ctypes call into the native library
(``native/tierkv_io.c``, which compiles xxHash's own header), releasing the GIL. Where the library is not
available (no compiler, a wheel built without it) it falls back to the ``xxhash`` package row by row, a mode
logged once. Both give the same digests (the same algorithm and seed): files and checksums written through
either path verify through the other. The native engine goes further and hashes each slot on its I/O
threads as it lands (``DiskFile.submit_hashed_reads``).
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np
from xxhash import xxh3_64_intdigest

from tierkv.io import native

log = logging.getLogger("tierkv")

_u64p = ctypes.POINTER(ctypes.c_uint64)


@functools.cache
def _native_rows() -> ctypes.CDLL | None:
    """The native library if it loads (its build is cached per process), else None, logged once."""
    try:
        return native.library()
    except native.EngineUnavailableError as exc:
        log.info("disk checksums: the xxhash package, one call per block (native library unavailable: %s)",
                 exc.reason)
        return None


def xxh3_rows(rows: np.ndarray) -> np.ndarray:
    """xxh3-64 (seed 0) of each row of ``rows`` ``[n, row_bytes]`` uint8 (rows contiguous, any row stride),
    as ``[n]`` uint64 — equal to ``xxhash.xxh3_64_intdigest(row)`` for every row."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or (rows.size > 1 and rows.shape[1] > 1 and rows.strides[1] != 1):
        raise ValueError(f"xxh3_rows wants [n, row_bytes] uint8 rows with contiguous bytes; got {rows.dtype} "
                         f"{rows.shape} strides {rows.strides}.")
    out = np.empty(rows.shape[0], dtype=np.uint64)
    lib = _native_rows()
    if lib is None or rows.shape[0] == 0:
        for index, row in enumerate(rows):
            out[index] = xxh3_64_intdigest(row)
        return out
    lib.tkv_xxh3_rows(ctypes.c_void_p(rows.ctypes.data), rows.strides[0], rows.shape[1], rows.shape[0],
                      out.ctypes.data_as(_u64p))
    return out
