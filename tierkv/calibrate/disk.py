"""Disk links: each engine beside a raw O_DIRECT baseline, and reads of one layer's blocks as the disk tier issues them.

Every engine moves one batch of ``size``-byte requests over a file of ``disk_bytes``, beside *raw*: 16 threads
issuing bare O_DIRECT ``preadv``/``pwritev`` of the same request size (no engine, no checks). The file holds
real data (a sparse or fallocated file reads as zeros without touching the disk); an engine that had to fall
back to buffered I/O gets its page cache dropped before each read and its writes fsync'd.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tierkv import safefs
from tierkv.calibrate.config import BenchConfig, MiB
from tierkv.calibrate.report import SILENT, Progress, point_cost
from tierkv.calibrate.results import Measurement
from tierkv.calibrate.timing import median_seconds, seconds
from tierkv.io import ALIGN, DiskFile, aligned_empty, available_engines, open_disk_file
from tierkv.io.base import chunk_bytes, queue_depth
from tierkv.units import format_bytes


class RawDirect:
    """The baseline: ``depth`` threads issuing bare O_DIRECT preadv/pwritev, pulling from one counter.

    No request checks, no splitting, no handles: what the filesystem gives a minimal program at this queue
    depth and request size. The threads persist across calls, as an engine's do, so neither side pays
    thread start-up inside the timing.
    """

    def __init__(self, path: Path, depth: int) -> None:
        self._fd = safefs.open_path(path, os.O_RDWR | os.O_DIRECT)
        self._depth = depth
        self._pool = cf.ThreadPoolExecutor(depth, thread_name_prefix="tierkv-raw-io")

    def run(self, requests: list[tuple[int, np.ndarray]], write: bool) -> None:
        call = os.pwritev if write else os.preadv
        counter = itertools.count()

        def worker() -> None:
            while (i := next(counter)) < len(requests):
                offset, view = requests[i]
                done = 0
                while done < view.nbytes:
                    moved = call(self._fd, [view[done:].data], offset + done)
                    if moved <= 0:
                        raise OSError(
                            f"raw O_DIRECT {'write' if write else 'read'} stalled at {offset + done}"
                        )
                    done += moved

        for future in [self._pool.submit(worker) for _ in range(min(self._depth, len(requests)))]:
            future.result()

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self._fd)


def drop_page_cache(path: Path) -> None:
    """Evict the file's clean pages so a buffered read comes from the disk, not from RAM."""
    fd = safefs.open_path(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_disk(sizes: Sequence[int], cfg: BenchConfig,
                 progress: Progress = SILENT) -> tuple[list[Measurement], list[str]]:
    """disk->host and host->disk through each engine and the raw baseline; returns (rows, notes). Three phases
    for ``progress``: writing the test file, the transfers of each size, the batches of blocks (the whole
    sweep takes a minute or more)."""
    engines = list(cfg.engines) if cfg.engines is not None else available_engines()
    if not engines:
        raise ValueError("no disk engine to measure; give at least one of the available engines.")
    notes: list[str] = []
    depth = queue_depth()
    sizes = [s for s in sizes if s <= cfg.disk_bytes]
    progress.phase(f"disk: writing the {format_bytes(cfg.disk_bytes)} test file in {cfg.directory}")  # tens of s
    buffer = aligned_empty(min(cfg.disk_bytes, max(max(sizes), cfg.disk_point_bytes)))
    buffer[:] = np.random.default_rng(1).integers(0, 256, buffer.nbytes, dtype=np.uint8)
    out = []
    with safefs.scratch_file(cfg.directory, f"tierkv-bench-{os.getpid()}-", cfg.disk_bytes) as path:
        files = {name: open_disk_file(path, engine=name) for name in engines}
        raw: RawDirect | None = None
        try:
            fill_file(files[engines[0]], path, buffer, cfg.disk_bytes)
            try:
                raw = RawDirect(path, depth)
            except OSError as exc:
                notes.append(
                    f"raw O_DIRECT baseline skipped: the filesystem refuses O_DIRECT ({exc.strerror})"
                )
            for name, f in files.items():
                mode = "O_DIRECT" if f.direct else "buffered (page cache dropped before reads)"
                notes.append(f"{name}: {mode}, queue depth {depth}, pieces of {chunk_bytes() // MiB} MiB")
            methods = len(files) + (raw is not None)
            progress.phase(f"disk: reads and writes of {format_bytes(sizes[0])} to {format_bytes(sizes[-1])}",
                           [point_cost(_point_bytes(size, cfg), cfg) for size in sizes for _ in range(2 * methods)])
            for size in sizes:
                requests = [(i * size, buffer[i * size : (i + 1) * size])
                            for i in range(_point_bytes(size, cfg) // size)]
                n = len(requests)
                for write in (False, True):
                    link = "host->disk" if write else "disk->host"
                    if raw is not None:
                        t = median_seconds(functools.partial(raw.run, requests, write),
                                            warmup=cfg.warmup, repeats=cfg.repeats)  # fmt: skip
                        out.append(Measurement(link, "raw O_DIRECT", size, n * size, n, t))
                        progress.point()
                    for name, f in files.items():
                        t = median_seconds(functools.partial(engine_batch, f, requests, write, path),
                                            warmup=cfg.warmup, repeats=cfg.repeats)  # fmt: skip
                        out.append(Measurement(link, name, size, n * size, n, t))
                        progress.point()
            progress.phase("disk: batches of scattered blocks",
                           [point_cost(k * cfg.block_bytes, cfg, max(1, 16 // k))
                            for _ in files for k in _block_counts(cfg, buffer)])
            for name, f in files.items():
                out += _block_batches(f, name, path, buffer, cfg, progress)
        finally:
            for f in files.values():
                f.close()
            if raw is not None:
                raw.close()
    return out, notes


def _point_bytes(size: int, cfg: BenchConfig) -> int:
    """Bytes one timed batch of ``size``-byte requests moves: up to 1,024 requests, at most ``disk_point_bytes``
    (but one request), within the file."""
    return min(cfg.disk_bytes, max(size, min(size * 1024, cfg.disk_point_bytes)))


LAYER_COPY_BLOCKS = 16  # memory copied between two batches: a layer's other blocks, as in a decode step
BATCH_BLOCKS = (1, 2, 4, 8, 16, 32, 64)  # blocks per batch: a layer's disk blocks in a decode step


def _block_counts(cfg: BenchConfig, buffer: np.ndarray) -> list[int]:
    """The batch sizes :func:`_block_batches` measures: those the file and the buffer hold."""
    block = cfg.block_bytes - cfg.block_bytes % ALIGN
    return [k for k in BATCH_BLOCKS if k <= min(cfg.disk_bytes // block, buffer.nbytes // block)]


def _block_batches(f: DiskFile, name: str, path: Path, buffer: np.ndarray, cfg: BenchConfig,
                   progress: Progress = SILENT) -> list[Measurement]:
    """disk->host as the disk tier reads during a decode step: one batch of ``k`` block-sized requests at
    scattered slots (a layer's disk blocks), for ``k`` = 1..64; each timed batch reads other slots. In a step
    the disk tier never reads back to back: between two layers' batches the mover copies the layers' other
    blocks, so an untimed copy of :data:`LAYER_COPY_BLOCKS` blocks precedes every timed batch (back-to-back
    batches read 7-15 % faster than a decode step's on a virtio disk, which would overstate the disk link)."""
    block = cfg.block_bytes - cfg.block_bytes % ALIGN
    slots = cfg.disk_bytes // block
    rng = np.random.default_rng(2)
    source = torch.ones(LAYER_COPY_BLOCKS * block, dtype=torch.uint8)
    copy = torch.empty_like(source)
    out = []
    for k in _block_counts(cfg, buffer):
        views = [buffer[i * block : (i + 1) * block] for i in range(k)]

        def batch(k: int = k, views: list[np.ndarray] = views) -> float:
            offsets = rng.choice(slots, size=k, replace=False) * block
            requests = list(zip((int(o) for o in offsets), views))
            copy.copy_(source)  # untimed: the layer's memory copies before its disk batch
            return seconds(lambda: engine_batch(f, requests, False, path))

        for _ in range(cfg.warmup):
            batch()
        inner = max(1, 16 // k)
        t = statistics.median(sum(batch() for _ in range(inner)) / inner for _ in range(max(cfg.repeats, 5)))
        out.append(Measurement("disk->host", f"{name} block batch", k * block, k * block, 1, t))
        progress.point()
    return out


def fill_file(f: DiskFile, path: Path, buffer: np.ndarray, disk_bytes: int) -> None:
    """Write real data over the whole file: holes and fallocated extents read as zeros without disk I/O."""
    step = buffer.nbytes - buffer.nbytes % ALIGN
    f.submit_writes(
        [(off, buffer[: min(step, disk_bytes - off)]) for off in range(0, disk_bytes, step)]
    ).wait()
    fd = safefs.open_path(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def engine_batch(f: DiskFile, requests: list[tuple[int, np.ndarray]], write: bool, path: Path) -> None:
    """One timed batch. Buffered engines get their cache dropped (reads) or fsync'd (writes) so the
    number is the disk's, not the page cache's."""
    if not f.direct and not write:
        drop_page_cache(path)
    handle = f.submit_writes(requests) if write else f.submit_reads(requests)
    handle.wait()
    if not f.direct and write:
        fd = safefs.open_path(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
