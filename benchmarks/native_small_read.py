"""One small read the caller waits for, through builds of the native engine side by side, and a raw read.

    cc -O2 -shared -fPIC -pthread -Inative -o /tmp/new.so native/tierkv_io.c   # (and an older source: old.so)
    python benchmarks/native_small_read.py /tmp/old.so /tmp/new.so [--bytes 65536]

Each library gets its own pool of ``--threads`` I/O threads on one O_DIRECT file (``--file``, written once with
random bytes); reads of ``--bytes`` at random aligned offsets go to each library in turn, hashed (xxh3 per
``--bytes``, as the disk tier asks), then one raw ``os.preadv`` of the same size, ``--rounds`` times. Medians
and 90th percentiles: what the engine adds to the disk for one small read (a sparse step's miss), measured
side by side so that this host's drift hits every build alike.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import random
import statistics
import sys
import time

import numpy as np

_I64P, _U64P = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint64)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.tkv_pool_new.restype, lib.tkv_pool_new.argtypes = ctypes.c_void_p, [ctypes.c_int]
    lib.tkv_submit.restype = ctypes.c_void_p
    lib.tkv_submit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                               _I64P, _I64P, _U64P, ctypes.c_int64, _U64P]
    lib.tkv_wait.restype = ctypes.c_int64
    lib.tkv_wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
    lib.tkv_batch_free.argtypes = [ctypes.c_void_p]
    return lib


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("libraries", nargs="+", help="built engines (.so) to compare")
    parser.add_argument("--file", default="/tmp/tierkv-small-read.bin")
    parser.add_argument("--file-mib", type=int, default=256)
    parser.add_argument("--bytes", type=int, default=65536, help="one read (a multiple of 4096)")
    parser.add_argument("--chunk", type=int, default=1 << 20, help="the engine's piece size")
    parser.add_argument("--threads", type=int, default=16, help="I/O threads per pool (tierkv's default)")
    parser.add_argument("--rounds", type=int, default=1500)
    args = parser.parse_args()
    size = args.file_mib << 20
    if not os.path.exists(args.file) or os.path.getsize(args.file) != size:
        with open(args.file, "wb") as out:
            for _ in range(args.file_mib):
                out.write(os.urandom(1 << 20))
    fd = os.open(args.file, os.O_RDONLY | os.O_DIRECT)
    buffer = mmap.mmap(-1, args.bytes)  # page-aligned, as O_DIRECT needs
    address = np.array([np.frombuffer(buffer, dtype=np.uint8).ctypes.data], dtype=np.uint64)
    length = np.array([args.bytes], dtype=np.int64)
    digests = np.empty(1, dtype=np.uint64)
    libraries = {path: load(path) for path in args.libraries}
    pools = {path: lib.tkv_pool_new(args.threads) for path, lib in libraries.items()}
    times: dict[str, list[float]] = {path: [] for path in libraries} | {"raw preadv": []}
    offsets = size // args.bytes
    for _ in range(args.rounds):
        for path, lib in libraries.items():
            offset = np.array([random.randrange(offsets) * args.bytes], dtype=np.int64)
            begun = time.perf_counter()
            batch = lib.tkv_submit(pools[path], fd, 0, args.chunk, 1, offset.ctypes.data_as(_I64P),
                                   length.ctypes.data_as(_I64P), address.ctypes.data_as(_U64P), args.bytes,
                                   digests.ctypes.data_as(_U64P))
            code = ctypes.c_int32()
            failed = lib.tkv_wait(pools[path], batch, ctypes.byref(code))
            lib.tkv_batch_free(batch)
            times[path].append(time.perf_counter() - begun)
            if failed >= 0:
                raise SystemExit(f"{path}: read failed with errno {code.value}")
        begun = time.perf_counter()
        os.preadv(fd, [buffer], random.randrange(offsets) * args.bytes)
        times["raw preadv"].append(time.perf_counter() - begun)
    for name, samples in times.items():
        samples.sort()
        print(f"{name}: median {statistics.median(samples) * 1e3:.3f} ms, "
              f"p90 {samples[int(len(samples) * 0.9)] * 1e3:.3f} ms ({len(samples)} reads of {args.bytes} B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
