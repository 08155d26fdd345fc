"""Timed reads: ``store.read_into`` with a probe that times each source tier's part for the telemetry and trace.

Both executors (exact gather, streaming) use it when a :class:`~tierkv.stats.Timeline` or
:class:`~tierkv.stats.Trace` is on. On CPU hosts the marks are ``perf_counter`` floats; on CUDA (and its
stand-in) they are events recorded on the stream that runs the copies (the mover's, or the device's compute
stream for synchronous reads), resolved later by :func:`resolve_cuda_events` so timing never synchronises
the compute stream.
A tier's part runs from its submission to its data landing: the disk part (submitted first, landed last)
spans the memory parts it overlaps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tierkv.accel import HostOnly
from tierkv.blocks import Tier
from tierkv.stats import ReadTiming, Trace
from tierkv.store import KVStore, ReadPlan
from tierkv.tiers.base import PendingRead

LINK_OF_TIER = {Tier.DEVICE: "device->device", Tier.HOST: "host->device", Tier.DISK: "disk->device"}


class TimedProbe:
    """A :class:`~tierkv.store.ReadProbe` that appends one :class:`ReadTiming` per source tier."""

    def __init__(self, layer: int, timings: list[ReadTiming], *, accel: HostOnly, device: torch.device,
                 trace: Trace | None, category: str) -> None:
        self.layer, self.timings, self.trace, self.category = layer, timings, trace, category
        self.accel, self.device, self.cuda = accel, device, accel.streams

    def _mark(self) -> Any:
        """An event recorded on the stream this thread issues the copies on (the mover's, or the compute's)."""
        event = self.accel.Event(timing=True)
        event.record(self.accel.current_stream(self.device))
        return event

    def begin(self, tier: Tier) -> tuple[float, Any]:
        begun = time.perf_counter()
        return begun, self._mark() if self.cuda else begun

    def end(self, mark: tuple[float, Any], tier: Tier, nbytes: int, copies: int) -> None:
        begun, start = mark
        ended = time.perf_counter()
        link = LINK_OF_TIER[tier]
        # the profile's latencies are per call (one batched engine read, one gather pass); on CUDA each host
        # run is its own copy across the link
        calls = copies if self.cuda and tier == Tier.HOST else 1
        self.timings.append(ReadTiming(link, nbytes, calls, start, self._mark() if self.cuda else ended))
        if self.trace is not None:
            self.trace.span(f"{link} L{self.layer}", self.category, begun, ended, layer=self.layer, bytes=nbytes,
                            copies=calls)


def timed_read(store: KVStore, layer: int, plan: ReadPlan, dest: torch.Tensor, timings: list[ReadTiming], *,
               accel: HostOnly, trace: Trace | None, category: str, ahead: PendingRead | None = None) -> None:
    """``store.read_into(layer, plan, dest)``, appending one timing per source tier to ``timings``."""
    probe = TimedProbe(layer, timings, accel=accel, device=store.device.device, trace=trace, category=category)
    store.read_into(layer, plan, dest, probe=probe, ahead=ahead)


def resolve_cuda_events(start: Any, end: Any, block: bool) -> float | None:
    """Seconds between two recorded events; None while ``end`` has not completed and ``block`` is False."""
    if block:
        end.synchronize()
    elif not end.query():
        return None
    return start.elapsed_time(end) / 1e3
