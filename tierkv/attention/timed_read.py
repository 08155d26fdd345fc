"""Timed reads: ``store.read_into`` split by source tier, each part timed for the telemetry and the trace.

Both executors (exact gather, streaming) use it when a :class:`~tierkv.stats.Timeline` or
:class:`~tierkv.stats.Trace` is on. On CPU hosts the marks are ``perf_counter`` floats; on CUDA they are
events recorded on the stream that runs the copies (the mover's, or the compute stream for synchronous
reads), resolved later by :func:`resolve_cuda_events` so timing never synchronises the compute stream.
"""

from __future__ import annotations

import time

import torch

from tierkv.blocks import Tier
from tierkv.stats import ReadTiming, Trace
from tierkv.store import KVStore, ReadSegment

LINK_OF_TIER = {Tier.DEVICE: "device->device", Tier.HOST: "host->device", Tier.DISK: "disk->device"}


def timed_read(store: KVStore, layer: int, segments: list[ReadSegment], dest: torch.Tensor,
               timings: list[ReadTiming], *, cuda: bool, trace: Trace | None, category: str) -> None:
    """``store.read_into(layer, segments, dest)`` one source tier at a time, appending one timing per tier."""
    by_tier: dict[Tier, list[ReadSegment]] = {}
    for seg in segments:
        by_tier.setdefault(seg.tier, []).append(seg)
    token_bytes = store.layouts[layer].token_bytes
    for tier, group in by_tier.items():
        link = LINK_OF_TIER[tier]
        # one batched engine read (disk) or one read_into pass (memory tiers): the profile's latencies are per
        # call (bench fits `store read_into` and disk block batches per call); on CUDA each host run is a copy
        copies = len(group) if cuda and tier == Tier.HOST else 1
        timing = ReadTiming(link, sum(seg.length for seg in group) * token_bytes, copies)
        begun = time.perf_counter()
        timing.start = cuda_mark() if cuda else begun
        store.read_into(layer, group, dest)
        ended = time.perf_counter()
        timing.end = cuda_mark() if cuda else ended
        timings.append(timing)
        if trace is not None:
            trace.span(f"{link} L{layer}", category, begun, ended, layer=layer, bytes=timing.nbytes, copies=copies)


def cuda_mark() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream: the mover's copy stream, or the compute stream for sync reads
    return event


def resolve_cuda_events(start: torch.cuda.Event, end: torch.cuda.Event, block: bool) -> float | None:
    """Seconds between two recorded events; None while ``end`` has not completed and ``block`` is False."""
    if block:
        end.synchronize()
    elif not end.query():
        return None
    return start.elapsed_time(end) / 1e3
