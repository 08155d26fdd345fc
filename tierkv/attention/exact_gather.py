"""Exact gather: assemble each layer's K/V on the device from all tiers, prefetching layers ahead.

The model's own attention (eager, sdpa, flash) then runs unchanged on the assembled tensors, so results
equal a plain in-memory cache. Staging buffers live in device memory counted against the device budget:
``prefetch_depth + 1`` of them, each big enough for one layer's K/V of the whole batch, in whole blocks::

    staging[i]: [2, B, H_kv, capacity, D]   (K = [0], V = [1]; capacity grows by 25% steps, block aligned)

A layer's staging starts at the block that holds its first attended token (a sliding window may start
mid-block); the model gets a view from that token on. While layer L attends over staging[a], the mover
fills staging[b] with every block layer L+1 already had. When layer L+1's ``update`` arrives, only the
blocks that were not yet full (the tail, and anything appended since) are read on top.

Telemetry (optional :class:`~tierkv.stats.Timeline`): each read job is split by source tier and timed per
link (``perf_counter`` on CPU hosts, CUDA events on the stream that ran the copies); the time between one
layer's gather returning and the next layer's gather starting is that layer's compute. An optional
:class:`~tierkv.stats.Trace` gets the same spans. ``prefetch_depth="auto"`` starts at 1 and, after
:data:`AUTO_AFTER_STEPS` decode steps, sets the depth from the bandwidth model
(:func:`tierkv.stats.choose_prefetch_depth`); it decides again after staging grows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierkv import settings
from tierkv.attention.base import READ_AHEAD, PipelinedExecutor, from_first_token, register_executor, wait_quietly
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.staging import gather_capacity
from tierkv.stats import ReadTiming, Timeline, Trace, choose_prefetch_depth
from tierkv.store import KVStore

log = logging.getLogger("tierkv")

AUTO_AFTER_STEPS = 2  # decode steps measured before prefetch_depth="auto" decides (and after staging grows)


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Block columns ``[first, first + columns)`` of ``layer`` on their way into staging buffer ``buffer``;
    the first ``full`` of them were full when planned (immutable since, unless the table is edited)."""

    layer: int
    buffer: int
    first: int
    columns: int
    full: int
    version: int
    handle: MoveHandle
    timings: list[ReadTiming] | None = None  # filled by the mover when telemetry is on


@register_executor
class ExactGather(PipelinedExecutor):
    name = "exact_gather"

    def __init__(self, store: KVStore, mover: ThreadMover, *, start_of: Callable[[int], int] = from_first_token,
                 num_layers: int | None = None, prefetch_depth: int | str = 1, timeline: Timeline | None = None,
                 trace: Trace | None = None) -> None:
        if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int) or prefetch_depth < 0):
            raise InvalidConfigError(f"prefetch_depth must be an int >= 0 or 'auto', got {prefetch_depth!r}.")
        super().__init__(store, mover, start_of=start_of, num_layers=num_layers, timeline=timeline, trace=trace)
        self.auto = prefetch_depth == "auto"
        # Layers with less KV than this are not prefetched: the mover's hand-off (a thread switch, ~50-100 µs
        # on a 2-core host) costs more than the copy it overlaps (see docs/benchmarks.md, "Scale").
        self.prefetch_min: int = settings.get("prefetch_min")
        self.prefetch_depth: int = 1 if self.auto else int(prefetch_depth)
        self.auto_choices: list[dict] = []  # decisions of prefetch_depth="auto", oldest first
        self._auto_wait = AUTO_AFTER_STEPS  # decode steps left before the next "auto" decision
        self._resize = False  # the next _ensure_capacity reallocates (the depth changed)
        self._left_at: float | None = None  # perf_counter when the last gather returned
        self._last_stop: dict[int, int] = {}
        self.capacity = 0  # tokens per staging buffer (whole blocks)
        self.batch = 0
        self.token_bytes = 0  # max over layers seen
        self.buffers: list[torch.Tensor] = []
        self._views: dict[tuple, torch.Tensor] = {}  # (buffer, layout, batch) -> typed staging view
        self.pending: dict[int, Prefetch] = {}
        self._next_cache: dict[tuple[int, int, int, bool], tuple[int, ...]] = {}  # see _next_layers
        self.current = -1  # staging buffer the model is attending over now
        self.prefetch_disabled_logged = False

    # ---------------------------------------------------------------------------------- public
    def gather(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, H_kv, T, D]`` of tokens ``[start, seq_length)`` of ``layer`` (views of staging)."""
        entered = time.perf_counter()
        new_pass = layer <= self.last_layer
        stop = self.store.seq_length(layer)
        if self.timeline is not None:
            self._record_pass(layer, stop, entered, new_pass)
        elif self.trace is not None and self._left_at is not None:
            self.trace.span(f"compute L{self.last_layer}", "compute", self._left_at, entered)
        self._see_layer(layer)
        bt = self.store.block_tokens
        first, end = start // bt, -(-stop // bt)
        batch = self.store.batch_size(layer)
        prefetched = self.pending.pop(layer, None)
        if prefetched is not None:
            waited_from = time.perf_counter()
            ok = wait_quietly(prefetched.handle)
            self._stalled(waited_from, layer)
            self._consume(prefetched)
            if not ok:
                prefetched = None
                self.prefetch_misses += 1
        self._ensure_capacity(batch, (end - first) * bt, self.store.layouts[layer].token_bytes)
        if prefetched is not None and prefetched.first == first and prefetched.version == self.version \
                and prefetched.columns <= end - first and prefetched.buffer < len(self.buffers):
            buffer, done = prefetched.buffer, prefetched.full
            self.prefetch_hits += 1
        else:
            buffer, done = self._free_buffer(), 0
            self.prefetch_misses += prefetched is not None
        staging = self._staging(buffer, layer, batch)
        plan = self.store.plan_read(layer, (first + done) * bt, stop)
        timings = self._read_now(layer, plan, staging[..., done * bt :, :])
        if self.timeline is not None:
            self.timeline.add_reads(layer, timings, sync=True)
        self.current = buffer
        self._prefetch_next(layer)
        offset, count = start - first * bt, stop - start
        self._left_at = time.perf_counter()
        kv = staging.narrow(3, offset, count)  # (narrow, then an int index: ~4 us, against ~9 for a 4-d slice)
        keys, values = kv[0], kv[1]
        self._accel.used(keys, values)
        return keys, values

    def invalidate(self) -> None:
        try:
            self.wait_all()
            for prefetch in self.pending.values():
                self._consume(prefetch)
        finally:
            self.pending.clear()
            self._drop_all_ahead()
            self.version += 1

    def reset(self) -> None:
        self.invalidate()
        self._last_stop.clear()  # the next sequence's first step counts all its tokens as new

    def drop(self, layer: int) -> None:
        prefetch = self.pending.pop(layer, None)
        if prefetch is not None:
            prefetch.handle.settle()
            self._consume(prefetch)
        for key in [key for key in self._disk_ahead if key[0] == layer]:
            self._drop_ahead_read(key)

    def wait_all(self) -> None:
        for prefetch in self.pending.values():
            prefetch.handle.settle()
        self._settle_ahead()

    def pause_telemetry(self) -> None:
        if self.timeline is not None:
            self.timeline.end_step(time.perf_counter())
        self._left_at = None
        self.last_layer = -1
        self._last_stop = {layer: self.store.seq_length(layer) for layer in self.store.layouts}

    def close(self) -> None:
        self.invalidate()
        self._release()
        if self.trace is not None and self.trace.path is not None:
            self.trace.save(self.trace.path)

    # --------------------------------------------------------------------------------- staging
    def _staging(self, buffer: int, layer: int, batch: int) -> torch.Tensor:
        """Staging buffer ``buffer`` as ``[2, B, H_kv, capacity, D]`` for ``layer``'s layout (views are cached
        until the buffers are reallocated)."""
        layout = self.store.layouts[layer]
        key = (buffer, layout, batch)
        view = self._views.get(key)
        if view is None:
            nbytes = batch * self.capacity * layout.token_bytes
            flat = self.buffers[buffer][:nbytes].view(layout.dtype)
            view = self._views[key] = flat.view(2, batch, layout.kv_heads, self.capacity, layout.head_dim)
        return view

    def _ensure_capacity(self, batch: int, tokens: int, token_bytes: int) -> None:
        if tokens <= self.capacity and batch <= self.batch and token_bytes <= self.token_bytes and not self._resize:
            return
        old_capacity, old_batch, old_token_bytes = self.capacity, self.batch, self.token_bytes
        if tokens <= old_capacity and batch <= old_batch and token_bytes <= old_token_bytes:
            capacity = old_capacity  # only the depth changed ("auto"): same buffers, another count
        else:
            self._auto_wait = AUTO_AFTER_STEPS  # the staging grows: "auto" decides again on the new sizes
            capacity = gather_capacity(tokens, self.store.block_tokens, old_capacity)
        self._resize = False
        self.invalidate()
        self._release()
        batch, token_bytes = max(batch, old_batch), max(token_bytes, old_token_bytes)
        per_buffer = batch * capacity * token_bytes
        count = self.prefetch_depth + 1
        while True:
            try:
                self.store.reserve_device(count * per_buffer)
                break
            except BudgetTooSmallError:
                if count == 1:
                    raise
                count = 1
                if not self.prefetch_disabled_logged:
                    log.warning("tierkv: the device budget cannot hold prefetch buffers for %d tokens; "
                                "prefetch is off until gpu_gb is raised", tokens)
                    self.prefetch_disabled_logged = True
        device = self.store.device.device
        self.buffers = [self._accel.empty(per_buffer, device) for _ in range(count)]
        self.capacity, self.batch, self.token_bytes = capacity, batch, token_bytes

    def _release(self) -> None:
        released = bool(self.buffers)
        if released:
            self.store.device.unreserve(sum(buffer.numel() for buffer in self.buffers))
        self.buffers = []
        self._views.clear()
        self.capacity = self.batch = self.token_bytes = 0
        self.current = -1
        if released:  # what the budget no longer counts must not stay reserved in CUDA's caching allocator
            self._accel.release_cached()

    def _free_buffer(self) -> int:
        if not self.pending:  # the common case without prefetch: any buffer but the one attended over
            return 1 if self.current == 0 and len(self.buffers) > 1 else 0
        busy = {self.current} | {p.buffer for p in self.pending.values()}
        free = next((i for i in range(len(self.buffers)) if i not in busy), None)
        if free is not None:
            return free
        victim = next(p for p in self.pending.values() if p.buffer != self.current) if self.pending else None
        if victim is None:
            return (self.current + 1) % len(self.buffers)
        victim.handle.settle()  # reuse its buffer: that prefetch is dropped, its layer will gather afresh
        del self.pending[victim.layer]
        self._consume(victim)
        return victim.buffer

    # -------------------------------------------------------------------------------- prefetch
    def _prefetch_next(self, layer: int) -> None:
        if len(self.buffers) < 2 or self.num_layers < 2:
            return
        for target in self._next_layers(layer, self.prefetch_depth):
            if target in self.pending or target not in self.store.layouts:
                continue
            busy = {self.current} | {p.buffer for p in self.pending.values()}
            free = [i for i in range(len(self.buffers)) if i not in busy]
            if not free:
                break
            self._issue(target, free[0])
        if Tier.DISK in self.store.tiers:
            beyond = self._next_layers(layer, self.prefetch_depth + READ_AHEAD)[self.prefetch_depth :]
            self._read_ahead((t, self.start_of(t), self.store.seq_length(t)) for t in beyond)

    def _next_layers(self, layer: int, count: int) -> tuple[int, ...]:
        """The ``count`` layers after ``layer`` in pass order (wrapping to layer 0 once the count is known)."""
        key = (layer, count, self.num_layers, self.layers_known)
        known = self._next_cache.get(key)
        if known is None:
            known = self._next_cache[key] = tuple(self._layers_after(layer, count))
        return known

    def _layers_after(self, layer: int, count: int) -> list[int]:
        out = []
        for ahead in range(1, count + 1):
            target = (layer + ahead) % self.num_layers
            if (target <= layer and not self.layers_known) or target == layer:
                break  # the layer count is not known yet: wrapping could target a layer that is not next
            out.append(target)
        return out

    def _issue(self, layer: int, buffer: int) -> None:
        bt = self.store.block_tokens
        start, stop = self.start_of(layer), self.store.seq_length(layer)
        first, end = start // bt, -(-stop // bt)
        batch = self.store.batch_size(layer)
        if (end - first) * bt > self.capacity or batch > self.batch or end <= first:
            return
        if (end - first) * batch * self.store.layouts[layer].block_bytes < self.prefetch_min:  # the plan's blocks
            return  # read it when the layer comes: a hand-off to the mover would cost more than it overlaps
        plan = self.store.plan_read(layer, start, stop, access=False)  # the access is the layer's gather
        full = stop // bt - first  # columns that are full now: the tail (if partial) is read again later
        handle, timings = self._read_later(layer, plan, self._staging(buffer, layer, batch))
        self.pending[layer] = Prefetch(layer, buffer, first, end - first, full, self.version, handle, timings)

    # ------------------------------------------------------------------------------- telemetry
    def _consume(self, prefetch: Prefetch) -> None:
        """A prefetch left the pending set (used, dropped or invalidated): count what it moved."""
        if self.timeline is not None and prefetch.timings is not None:
            self.timeline.add_reads(prefetch.layer, prefetch.timings, sync=False)

    def _record_pass(self, layer: int, stop: int, entered: float, new_pass: bool) -> None:
        timeline = self.timeline
        assert timeline is not None
        if self._left_at is not None:
            timeline.add_compute(self.last_layer, entered - self._left_at)
            if self.trace is not None:
                self.trace.span(f"compute L{self.last_layer}", "compute", self._left_at, entered)
        new_tokens = stop - self._last_stop.get(layer, 0)
        self._last_stop[layer] = stop
        if new_pass or timeline.current is None:
            if self.auto and timeline.current is not None and timeline.current.decode:
                self._auto_wait -= 1
            timeline.begin_step(entered, new_tokens, stop, self.prefetch_depth)
            if self.auto and self._auto_wait <= 0 and self.layers_known:
                self._auto_wait = 1 << 62  # until staging grows
                self._choose_depth()
        else:
            current = timeline.current
            current.new_tokens = max(current.new_tokens, new_tokens)  # sliding layers may have dropped blocks

    def _choose_depth(self) -> None:
        """``prefetch_depth="auto"``: set the depth from the last decode step's measured placement."""
        timeline = self.timeline
        layers = timeline.last_decode_layers() if timeline is not None else None
        if layers is None or not self.buffers or len(layers) != self.num_layers:
            self._auto_wait = 1
            return
        device, host = self.store.device, self.store.tiers[Tier.HOST]
        per_buffer = self.buffers[0].numel()
        tails = sum(layout.slot_bytes for layout in self.store.layouts.values()) * self.batch
        choice = choose_prefetch_depth(
            layers, timeline.profile, current=self.prefetch_depth, held_buffers=len(self.buffers),
            buffer_bytes=per_buffer, free_device_bytes=device.budget - device.allocated_bytes,
            max_buffers=(device.budget - tails) // per_buffer,
            free_host_bytes=host.budget - host.used_bytes)
        record = {"step": timeline.steps_seen - 1, **choice.as_dict()}
        self.auto_choices.append(record)
        del self.auto_choices[:-16]
        if choice.depth != self.prefetch_depth:
            log.info("tierkv: prefetch_depth auto: %d -> %d (%s)", self.prefetch_depth, choice.depth, choice.reason)
            self.prefetch_depth = choice.depth
            self._resize = True
