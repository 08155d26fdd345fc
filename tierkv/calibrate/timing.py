"""Timing rules every calibration series follows: warm up, repeat, keep the median; on CUDA, events after a sync.

Public because ``benchmarks/`` times its side-by-side comparisons the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tierkv.calibrate.config import MiB


def seconds(op: Callable[[], object]) -> float:
    """Wall time of one call of ``op``."""
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def median_seconds(op: Callable[[], object], *, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median wall time of ``op``; ``inner`` calls per sample so a sample is not all clock noise."""
    for _ in range(warmup):
        op()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            op()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def median_cuda_seconds(op: Callable[[], object], *, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median time of ``op`` between CUDA events on the current stream, synchronized before and after."""
    for _ in range(warmup):
        op()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            op()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    torch.cuda.synchronize()
    return statistics.median(samples)


def timer_for(device: torch.device) -> Callable[..., float]:
    """:func:`median_cuda_seconds` for work queued on a CUDA device, else :func:`median_seconds`."""
    return median_cuda_seconds if device.type == "cuda" else median_seconds


def inner_repeats(size: int) -> int:
    """Repetitions per sample: ~16 MiB per sample, so 4 KiB copies are timed over ~4000 calls."""
    return max(1, min(4096, (16 * MiB) // size))
