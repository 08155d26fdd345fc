"""The executor interface, its registry, and the prefetch bookkeeping every executor shares.

An executor decides how a layer attends over KV that lives in several tiers (exact gather, streaming,
later split and sparse). All of them read from the store through plans, prefetch ahead on the mover, and
must forget what they staged when the table is edited; :class:`PipelinedExecutor` holds that shared part.
The adapter (:mod:`tierkv.hf`) builds executors by name with everything they need::

    executor = EXECUTORS["exact_gather"](store, mover, start_of=..., num_layers=..., timeline=..., trace=...)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

from tierkv.attention.timed_read import resolve_cuda_events, timed_read
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.stats import ReadTiming, Timeline, Trace
from tierkv.store import KVStore, ReadPlan


class Executor(Protocol):
    """What the adapter needs of every executor."""

    name: str
    prefetch_hits: int
    prefetch_misses: int
    stall_s: float

    def invalidate(self) -> None:
        """Table edits (crop, reorder, reset, a rollback) make staged data stale: forget it."""

    def reset(self) -> None:
        """The store was reset: forget staged data and per-sequence telemetry state."""

    def drop(self, layer: int) -> None:
        """Forget ``layer``'s prefetch (its token positions shifted: a sliding window dropped blocks)."""

    def wait_all(self) -> None:
        """The store's barrier: no read of this executor is still in flight (raises nothing)."""

    def pause_telemetry(self) -> None:
        """Another executor takes over: end the step in progress."""

    def close(self) -> None: ...


EXECUTORS: dict[str, type] = {}


def register_executor(cls: type) -> type:
    EXECUTORS[cls.name] = cls
    return cls


def from_first_token(layer: int) -> int:
    """Full attention: every layer attends from its first stored token."""
    return 0


class PipelinedExecutor:
    """Shared state of executors that prefetch layer by layer on a mover.

    ``start_of(layer)`` is the first stored token a layer's attention reads (sliding windows start later);
    ``num_layers`` is known up front when the cache was built from a config, else learnt from the first
    full pass — until then prefetch never wraps to layer 0. The executor registers with the store as a
    reader, so the store's barrier waits for its reads.
    """

    name = ""

    def __init__(self, store: KVStore, mover: ThreadMover, *, start_of: Callable[[int], int] = from_first_token,
                 num_layers: int | None = None, timeline: Timeline | None = None, trace: Trace | None = None) -> None:
        self.store = store
        self.mover = mover
        self.start_of = start_of
        self.num_layers = num_layers or 0
        self.layers_known = num_layers is not None
        self.timeline = timeline
        self.trace = trace
        self._cuda = store.device.device.type == "cuda"
        if timeline is not None and self._cuda:
            timeline.resolve = resolve_cuda_events
        self.last_layer = -1
        self.version = 0  # bumped by table edits that invalidate staged data
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.stall_s = 0.0  # time the model waited for prefetches to land
        store.add_reader(self)

    @property
    def timed(self) -> bool:
        return self.timeline is not None or self.trace is not None

    def _see_layer(self, layer: int) -> None:
        """Called as each layer starts: learns the layer count from the first full pass."""
        if layer == 0 and self.num_layers > 1 and self.last_layer == self.num_layers - 1:
            self.layers_known = True  # a full pass was seen: wrapping prefetch to layer 0 is now safe
        self.num_layers = max(self.num_layers, layer + 1)
        self.last_layer = layer

    def _read_now(self, layer: int, plan: ReadPlan, dest: torch.Tensor) -> list[ReadTiming]:
        """A synchronous read on the caller's thread (a miss, or a top-up of a prefetch)."""
        timings: list[ReadTiming] = []
        if not self.timed:
            self.store.read_into(layer, plan, dest)
        else:
            timed_read(self.store, layer, plan, dest, timings, cuda=self._cuda, trace=self.trace, category="read")
        return timings

    def _read_later(self, layer: int, plan: ReadPlan, dest: torch.Tensor) -> tuple[MoveHandle, list[ReadTiming] | None]:
        """A read on the mover; its timings list fills when the job runs (None when telemetry is off)."""
        if not self.timed:
            return self.mover.submit(lambda: self.store.read_into(layer, plan, dest)), None
        timings: list[ReadTiming] = []
        return self.mover.submit(lambda: timed_read(self.store, layer, plan, dest, timings, cuda=self._cuda,
                                                    trace=self.trace, category="prefetch")), timings

    def _stalled(self, since: float, layer: int) -> float:
        """The model waited from ``since`` until now for data of ``layer``: stall, not compute."""
        now = time.perf_counter()
        self.stall_s += now - since
        if self.timeline is not None:
            self.timeline.add_stall(now - since)
        if self.trace is not None:
            self.trace.span(f"wait L{layer}", "stall", since, now)
        return now - since


def wait_quietly(handle: MoveHandle) -> bool:
    """Wait for a prefetch; False if it failed (a miss: the synchronous read then reports the error)."""
    try:
        handle.wait()
    except Exception:  # noqa: BLE001
        return False
    return True

