"""Timed reads: ``store.read_into`` with its per-tier part timings turned into the telemetry's and trace's records.

Both executors (exact gather, streaming) use it when a :class:`~tierkv.stats.Timeline` or
:class:`~tierkv.stats.Trace` is on. The store times each source tier's part as it lands
(:class:`~tierkv.store.PartTiming`): on CPU hosts the marks are ``perf_counter`` floats; on CUDA (and its
stand-in) they are events recorded on the stream that runs the copies (the mover's, or the device's compute
stream for synchronous reads), resolved later by :func:`resolve_cuda_events` so timing never synchronises
the compute stream.
A tier's part runs from its submission to its data landing: the disk part (submitted first, landed last)
spans the memory parts it overlaps.
"""

from __future__ import annotations

from typing import Any

import torch

from tierkv.accel import HostOnly
from tierkv.blocks import Tier
from tierkv.stats import ReadTiming, Trace
from tierkv.store import KVStore, PartTiming, ReadPlan
from tierkv.tiers.base import PendingRead

LINK_OF_TIER = {Tier.DEVICE: "device->device", Tier.HOST: "host->device", Tier.DISK: "disk->device"}


def timed_read(store: KVStore, layer: int, plan: ReadPlan, dest: torch.Tensor, timings: list[ReadTiming], *,
               accel: HostOnly, trace: Trace | None, category: str, ahead: PendingRead | None = None) -> None:
    """``store.read_into(layer, plan, dest)``, appending one timing per source tier to ``timings`` (also for the
    parts that landed before a read failed)."""
    parts: list[PartTiming] = []
    try:
        store.read_into(layer, plan, dest, timings=parts, ahead=ahead)
    finally:
        cuda = accel.streams
        for part in parts:
            link = LINK_OF_TIER[part.tier]
            # the profile's latencies are per call (one batched engine read, one gather pass); on CUDA each host
            # run is its own copy across the link
            calls = part.copies if cuda and part.tier == Tier.HOST else 1
            timings.append(ReadTiming(link, part.nbytes, calls, part.start_event if cuda else part.begun,
                                      part.end_event if cuda else part.ended))
            if trace is not None:
                trace.span(f"{link} L{layer}", category, part.begun, part.ended, layer=layer, bytes=part.nbytes,
                           copies=calls)


def resolve_cuda_events(start: Any, end: Any, block: bool) -> float | None:
    """Seconds between two recorded events; None while ``end`` has not completed and ``block`` is False."""
    if block:
        end.synchronize()
    elif not end.query():
        return None
    return start.elapsed_time(end) / 1e3
