"""The host attention kernel's rate (``LinkProfile.host_attention``): bytes of K/V attended per second in place.

What the split executor's host share costs. :func:`~tierkv.attention.host_kernel.paged_attention` attends one
decode query (Llama-3-8B's 32 query heads over its 8 KV heads, fp16 K/V) over 1/64, 1/16 and 1/4 of a slab of
``gather_pool_bytes`` (16, 64 and 256 MiB by default: past the call's fixed cost, which dominates small reads),
through a block table, on one thread and on every thread torch uses; consecutive calls walk through the slab, so
they read memory that is not in the CPU's last-level cache (as the store gather's series do). Each series is
fitted like a link (latency + bytes / bandwidth); its slope is the rate. Where the C kernel cannot be built, the
torch fallback is what split runs, so that is what is measured (and named).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tierkv.bandwidth import HostAttention, fit_link
from tierkv.calibrate.config import BenchConfig
from tierkv.calibrate.kv import HEAD_DIM, KV_DTYPE, KV_HEADS, KV_TOKEN_BYTES, block_tokens
from tierkv.calibrate.report import SILENT, Progress, point_cost
from tierkv.calibrate.results import Measurement
from tierkv.calibrate.timing import inner_repeats, median_seconds

ATTENTION = "host attention"
"""The ``link`` of the series (not a profile link: a rate of attending, not of moving)."""
QUERY_HEADS = 32  # Llama-3-8B: 32 query heads over 8 KV heads


def method(threads: int) -> str:
    """The series' method: ``paged, 1 thread`` / ``paged, 4 threads``."""
    return f"paged, {threads} thread{'s' if threads > 1 else ''}"


def attention_sizes(cfg: BenchConfig) -> list[int]:
    """1/64, 1/16 and 1/4 of the gather pool, in whole blocks (distinct sizes of at least one block)."""
    block = block_tokens(cfg) * KV_TOKEN_BYTES
    return sorted({share - share % block for share in (cfg.gather_pool_bytes // d for d in (64, 16, 4))
                   if share >= block})


def measure_host_attention(cfg: BenchConfig,
                           progress: Progress = SILENT) -> tuple[list[Measurement], HostAttention | str]:
    """Time the kernel over :func:`attention_sizes` bytes of K/V on one thread and on all of torch's; return the
    series and the fitted :class:`HostAttention`, or why it could not be fitted."""
    from tierkv.attention import host_kernel

    tokens_per_block = block_tokens(cfg)
    block = tokens_per_block * KV_TOKEN_BYTES
    sizes = attention_sizes(cfg)
    if len(sizes) < 2:
        return [], f"{ATTENTION}: the gather pool holds too few blocks for 2 sizes (give a larger pool)"
    everyone = torch.get_num_threads()
    progress.phase("the host attention kernel (K/V attended in place)",
                   [point_cost(size, cfg, inner_repeats(size)) / threads
                    for threads in sorted({1, everyone}) for size in sizes])
    slots = cfg.gather_pool_bytes // block
    slab = torch.ones(slots, 2, KV_HEADS, tokens_per_block, HEAD_DIM, dtype=KV_DTYPE)
    query = torch.ones(1, QUERY_HEADS, 1, HEAD_DIM)
    scaling = HEAD_DIM**-0.5
    out: list[Measurement] = []
    rates: dict[int, float] = {}
    failures = []
    for threads in sorted({1, everyone}):
        series = []
        for size in sizes:
            n = size // block
            tables = itertools.cycle([np.arange(first, first + n, dtype=np.int64)[None]
                                      for first in range(0, slots - n + 1, n)])  # fmt: skip

            def attend(tables: itertools.cycle = tables, n: int = n, threads: int = threads) -> None:
                host_kernel.paged_attention(query, slab, next(tables), n * tokens_per_block, scaling=scaling,
                                            threads=threads)  # fmt: skip

            seconds = median_seconds(attend, warmup=cfg.warmup, repeats=cfg.repeats, inner=inner_repeats(size))
            series.append(Measurement(ATTENTION, method(threads), size, size, 1, seconds))
            progress.point()
        out += series
        try:
            rates[threads] = fit_link(method(threads), [m.size for m in series],
                                      [m.seconds for m in series]).bandwidth_bytes_per_s  # fmt: skip
        except ValueError as exc:
            failures.append(f"{ATTENTION}: not fitted ({exc})")
    if failures:
        return out, "; ".join(failures)
    kernel = "native" if host_kernel.available() else "torch"
    return out, HostAttention(rates[everyone], rates[1], everyone, kernel)
