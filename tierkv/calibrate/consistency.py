"""Signs that a calibration's numbers are not this host's own: other work on the host when it started, or points
that contradict each other. ``tierkv bench`` prints them as warnings, and records them in the profile, where
``tierkv plan --profile`` repeats them.

Two contradictions are physical, not matters of taste: within one series (a link and a method), a larger transfer
cannot take less time than a smaller one, so a transfer timed :data:`SLOWER_THAN_LARGER` times longer than a
larger one was interrupted; and the host attention kernel on every thread cannot be slower than on one, except
while other work takes the cores.
"""

from __future__ import annotations

import os
from collections import defaultdict

from tierkv.calibrate.results import BenchResult, Measurement
from tierkv.units import format_bytes

BUSY_LOAD_PER_CORE = 0.5  # a 1-minute load average above this share of the cores: other work skews the timings
SLOWER_THAN_LARGER = 3.0  # a transfer this many times slower than a larger one of its series was interrupted
RERUN = "re-run `tierkv bench` on a quiet machine for a profile to plan with"


def host_load() -> str | None:
    """Why the host is too busy to measure (its 1-minute load average against its cores), or None."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= BUSY_LOAD_PER_CORE * cores:
        return None
    return f"the host was busy when the run started (load average {load:.2f} on {cores} cores)"


def contradictions(result: BenchResult) -> list[str]:
    """Each series whose smaller transfer took far longer than a larger one (one line per series), and a host
    attention rate on every thread below the one-thread rate."""
    series: dict[tuple[str, str], list[Measurement]] = defaultdict(list)
    for m in result.measurements:
        if not m.method.endswith(" block batch"):  # one point per engine, sized by the batch, not a series
            series[(m.link, m.method)].append(m)
    found = []
    for (link, method), points in series.items():
        points.sort(key=_transfer_bytes)
        pair = next(((small, large) for i, small in enumerate(points) for large in points[i + 1:]
                     if _transfer_bytes(large) > _transfer_bytes(small)
                     and _per_transfer(small) > SLOWER_THAN_LARGER * _per_transfer(large)), None)
        if pair is not None:
            small, large = pair
            found.append(f"{link} {method}: {format_bytes(_transfer_bytes(small))} took "
                         f"{_per_transfer(small) / _per_transfer(large):,.0f}x as long as "
                         f"{format_bytes(_transfer_bytes(large))}")
    attention = result.profile.host_attention
    if attention is not None and attention.threads > 1 and \
            attention.bandwidth_bytes_per_s < attention.single_thread_bytes_per_s:
        found.append(f"host attention: {attention.threads} threads measured "
                     f"{attention.bandwidth_bytes_per_s / 1e9:.2f} GB/s, below 1 thread's "
                     f"{attention.single_thread_bytes_per_s / 1e9:.2f} GB/s (plans use the 1-thread rate)")
    return found


def _per_transfer(m: Measurement) -> float:
    """Seconds of one transfer (a request or a copy) of the timed operation."""
    return m.seconds / m.transfers


def _transfer_bytes(m: Measurement) -> float:
    """Bytes of one transfer (a per-block gather's transfers are its blocks, at every size)."""
    return m.nbytes / m.transfers
