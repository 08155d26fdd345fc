"""The cache's own work per layer on the compute thread (``LinkProfile.layer_overhead_s``), on CPU-only hosts.

Measured on the runtime's code, not modelled: the exact-gather executor's bookkeeping, the read of the newest
token and the submission of the next prefetch, per layer, from its own telemetry.
"""

from __future__ import annotations

import statistics

import torch

from tierkv import settings
from tierkv.bandwidth import LinkProfile
from tierkv.calibrate.config import BenchConfig
from tierkv.calibrate.kv import CPU, KV_TOKEN_BYTES, bench_store, block_tokens, kv_tensor
from tierkv.calibrate.report import SILENT, Progress

OVERHEAD_LAYERS, OVERHEAD_BLOCKS, OVERHEAD_STEPS = 8, 16, 20


def measure_layer_overhead(cfg: BenchConfig, progress: Progress = SILENT) -> float:
    """``LinkProfile.layer_overhead_s``: the cache's own work per layer on the compute thread, on the runtime's
    code. The exact-gather executor with layer-ahead prefetch runs decode steps over a device-tier store of
    :data:`OVERHEAD_LAYERS` layers of :data:`OVERHEAD_BLOCKS` blocks, one token appended per layer per step
    and no model; from its own telemetry, the time in ``gather`` outside the waits for prefetches (the
    bookkeeping, the read of the newest token, submitting the next prefetch), per layer, median over steps."""
    from tierkv.attention.base import Span
    from tierkv.attention.exact_gather import ExactGather
    from tierkv.mover import ThreadMover
    from tierkv.stats import Timeline

    progress.phase("the cache's own work per layer (decode steps of the exact-gather executor)")
    per_block = block_tokens(cfg)
    tokens = OVERHEAD_BLOCKS * per_block
    budget = OVERHEAD_LAYERS * (OVERHEAD_BLOCKS + 2) * per_block * KV_TOKEN_BYTES
    store = bench_store(cfg, budget + 4 * tokens * KV_TOKEN_BYTES, 0, CPU)
    kv, token = kv_tensor(tokens, CPU), kv_tensor(1, CPU)
    for layer in range(OVERHEAD_LAYERS):
        store.append(layer, kv, kv)
    with settings.override(prefetch_min=0):  # the pipelined path, whatever the layers' size
        timeline = Timeline(LinkProfile({}), "tierkv bench")
        executor = ExactGather(store, ThreadMover(), prefetch_depth=1, timeline=timeline)
    try:
        with torch.inference_mode():
            for _ in range(OVERHEAD_STEPS + 2):
                for layer in range(OVERHEAD_LAYERS):
                    store.append(layer, token, token)
                    executor.gather(Span.of(store, layer, 0))
        steps = [step for step in timeline.completed() if step.decode][-OVERHEAD_STEPS:]
        return statistics.median((step.wall_s - step.compute_s - step.stall_s) / OVERHEAD_LAYERS for step in steps)
    finally:
        executor.close()
        executor.mover.close()
        store.close()
