"""Contention on a CPU-only host: how much the mover's work and the compute slow each other.

The mover is one thread beside the model on the same cores and memory bus. Two mover jobs are measured
against a compute: the store's gather of device-tier blocks, and the disk tier's reads of a layer's blocks
(the engine's I/O threads and completions need the cores the compute holds). The factors go into
:class:`~tierkv.bandwidth.Contention`, which stretches each side where they overlap.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import itertools
import os
import statistics
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from tierkv import safefs
from tierkv.bandwidth import MAX_SLOWDOWN, Contention
from tierkv.calibrate.config import BenchConfig
from tierkv.calibrate.disk import engine_batch, fill_file
from tierkv.calibrate.kv import CPU, HEAD_DIM, KV_DTYPE, KV_HEADS, KV_TOKEN_BYTES, bench_store, block_tokens, kv_tensor
from tierkv.calibrate.report import SILENT, Progress
from tierkv.calibrate.timing import median_seconds, seconds
from tierkv.io import ALIGN, aligned_empty, open_disk_file

CONTENTION_SAMPLES = 9


def _samples(cfg: BenchConfig) -> int:
    """Samples of each side's slowdown: each is short and noisy, so at least :data:`CONTENTION_SAMPLES`."""
    return max(CONTENTION_SAMPLES, cfg.repeats)


def _slowdowns(job: Callable[[], None], unit: Callable[[], object], cfg: BenchConfig,
               progress: Progress = SILENT) -> tuple[float, float]:
    """How much compute (``unit`` repeated on the calling thread) and ``job`` (on a second thread, as the mover
    runs it) slow each other.

    The compute is ``unit`` repeated to last about as long as one job. Each sample times both alone, then
    the compute while the mover repeats the job the whole time, then one job while the compute repeats the
    whole time. Each side is measured under full overlap because that is what the model stretches; a single
    "together" time would hide the slowdown of whichever side ends first. Returns the medians over
    :func:`_samples` samples (each a point of ``progress``) of (compute beside the job / alone, job beside
    compute / alone), each clamped to [1, MAX_SLOWDOWN].
    """
    reps = max(1, round(median_seconds(job, warmup=cfg.warmup, repeats=cfg.repeats)
                        / median_seconds(unit, warmup=cfg.warmup, repeats=cfg.repeats)))

    def compute() -> None:
        for _ in range(reps):
            unit()

    compute_ratios, job_ratios = [], []
    with cf.ThreadPoolExecutor(max_workers=1) as mover:
        for _ in range(_samples(cfg)):
            compute_alone, job_alone = seconds(compute), seconds(job)
            started, stop = threading.Event(), threading.Event()

            def repeat_job(started: threading.Event = started, stop: threading.Event = stop) -> None:
                started.set()
                while not stop.is_set():
                    job()

            repeating = mover.submit(repeat_job)
            started.wait()
            compute_beside = seconds(compute)
            stop.set()
            repeating.result()
            running = mover.submit(seconds, job)
            while not running.done():
                unit()
            compute_ratios.append(compute_beside / compute_alone)
            job_ratios.append(running.result() / job_alone)
            progress.point()
    compute_ratio, job_ratio = (min(MAX_SLOWDOWN, max(1.0, statistics.median(r))) for r in (compute_ratios, job_ratios))
    return compute_ratio, job_ratio


DISK_CONTENTION_BATCH = 4  # blocks per read batch: a layer's disk blocks in a decode step


def measure_contention(cfg: BenchConfig, disk_engine: str | None, compute: Callable[[], object] | None = None,
                       progress: Progress = SILENT) -> Contention:
    """How the mover's work and compute slow each other on this CPU host (``_slowdowns``).

    Two mover jobs: the store's gather (``KVStore.read_into`` of ``contention_bytes`` of one layer from
    device-tier blocks, walking a pool 4x that size, as :func:`~tierkv.calibrate.links.measure_store_gather`
    and the executors do) and, with a ``disk_engine``, the disk tier's reads (batches of
    :data:`DISK_CONTENTION_BATCH` scattered block-sized requests, ``contention_bytes`` in all, from a file
    4x that size: the engine's I/O threads and completions need the cores the compute holds). ``compute``
    is one unit of the work to measure against, e.g. one decode step of your model; the default, a
    matrix-vector product over ``contention_bytes`` of weights, is decode's most memory-bound kernel, so its
    slowdown is an upper bound for a real model's. A phase of ``progress`` per job."""
    samples = [1.0] * _samples(cfg)
    progress.phase("the store's gather beside compute (contention)", samples)
    unit = compute or _matrix_vector(cfg.contention_bytes)
    with _store_gather_job(cfg) as gather:
        compute_by_copies, copies_by_compute = _slowdowns(gather, unit, cfg, progress)
    if disk_engine is None:
        return Contention(compute_by_copies, copies_by_compute)
    progress.phase(f"disk reads ({disk_engine}) beside compute (contention)", samples)
    with _disk_reads(cfg, disk_engine) as reads:
        compute_by_disk, disk_by_compute = _slowdowns(reads, unit, cfg, progress)
    return Contention(compute_by_copies, copies_by_compute, compute_by_disk, disk_by_compute)


def _matrix_vector(nbytes: int) -> Callable[[], object]:
    weights = torch.ones(nbytes // 4 // 1024, 1024)  # fp32 [rows, 1024]
    vector = torch.ones(1024)
    return lambda: torch.mv(weights, vector)


@contextlib.contextmanager
def _store_gather_job(cfg: BenchConfig) -> Iterator[Callable[[], None]]:
    """A job that gathers ``contention_bytes`` of one layer from device-tier blocks as the executors do."""
    per_block = block_tokens(cfg)
    layer_tokens = max(per_block, cfg.contention_bytes // KV_TOKEN_BYTES // per_block * per_block)
    pool_tokens = 4 * layer_tokens
    slack = 4 * per_block * KV_TOKEN_BYTES
    store = bench_store(cfg, pool_tokens * KV_TOKEN_BYTES + slack, slack, CPU)
    kv = kv_tensor(pool_tokens, CPU)
    store.append(0, kv, kv)
    del kv
    plans = itertools.cycle([store.plan_read(0, start, start + layer_tokens)
                             for start in range(0, pool_tokens - layer_tokens + 1, layer_tokens)])
    staging = torch.empty(2, 1, KV_HEADS, layer_tokens, HEAD_DIM, dtype=KV_DTYPE)
    try:
        yield lambda: store.read_into(0, next(plans), staging)
    finally:
        store.close()


@contextlib.contextmanager
def _disk_reads(cfg: BenchConfig, engine: str) -> Iterator[Callable[[], None]]:
    """A job that reads ``contention_bytes`` through ``engine`` as the disk tier does in a decode step."""
    block = cfg.block_bytes - cfg.block_bytes % ALIGN
    file_bytes = 4 * cfg.contention_bytes // block * block
    buffer = aligned_empty(min(file_bytes, max(cfg.contention_bytes, DISK_CONTENTION_BATCH * block)))
    buffer[:] = np.random.default_rng(3).integers(0, 256, buffer.nbytes, dtype=np.uint8)
    rng = np.random.default_rng(4)
    batches = max(1, cfg.contention_bytes // (DISK_CONTENTION_BATCH * block))
    views = [buffer[i * block : (i + 1) * block] for i in range(DISK_CONTENTION_BATCH)]
    with safefs.scratch_file(cfg.directory, f"tierkv-bench-contention-{os.getpid()}-", file_bytes) as path:
        disk_file = open_disk_file(path, engine=engine)
        try:
            fill_file(disk_file, path, buffer, file_bytes)

            def reads() -> None:
                for _ in range(batches):
                    offsets = rng.choice(file_bytes // block, size=DISK_CONTENTION_BATCH, replace=False) * block
                    engine_batch(disk_file, list(zip((int(o) for o in np.sort(offsets)), views)), False, path)

            yield reads
        finally:
            disk_file.close()
