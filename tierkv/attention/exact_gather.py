"""Exact gather: assemble each layer's K/V on the device from all tiers, prefetching layers ahead.

The model's own attention (eager, sdpa, flash) then runs unchanged on the assembled tensors, so results
equal a plain in-memory cache. Staging buffers live in device memory counted against the device budget:
``prefetch_depth + 1`` of them, each big enough for one layer's K/V of the whole batch, in whole blocks::

    staging[i]: [2, B, H_kv, capacity, D]   (K = [0], V = [1]; capacity grows by 25% steps, block aligned)

A layer's staging starts at the block that holds its first attended token (a sliding window may start
mid-block); the model gets a view from that token on. While layer L attends over staging[a], the mover
fills staging[b] with every block layer L+1 already had. When layer L+1's ``update`` arrives, only the
blocks that were not yet full (the tail, and anything appended since) are read on top.

A buffer is written again only once the model has let go of the K/V it was handed from it: models that share KV
across layers (Gemma 3n, Gemma 4) keep a layer's K/V for later layers of the same forward, so the buffer stays
theirs, and another is taken from the device budget when every buffer is in use
(:func:`tierkv.hf.sizing.kv_producers` counts them in ``min_device_bytes``).

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
import weakref

import torch

from tierkv import settings
from tierkv.attention.base import READ_AHEAD, ColumnRead, PipelinedExecutor, Span, register_executor, wait_quietly
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.mover import ThreadMover
from tierkv.staging import gather_capacity
from tierkv.stats import ReadTiming, Timeline, Trace, choose_prefetch_depth
from tierkv.store import KVStore
from tierkv.units import format_gb

log = logging.getLogger("tierkv")

AUTO_AFTER_STEPS = 2  # decode steps measured before prefetch_depth="auto" decides (and after staging grows)
BLOCK_GATHER_BYTES = 2048
"""What gathering one more block costs, in bytes of plain copy (``index_select``'s work per row): the size a
layer's read is weighed at against ``prefetch_min`` is its bytes plus this per block. On the 2-core CPU VM a
layer of 1,024 blocks of 2 KiB (2 MiB) ran 1.45x ``DynamicCache``'s step read when it came and 1.07x prefetched,
while 2 MiB in 64-512 larger blocks ran as fast or faster read when it came."""

_Records = tuple[tuple[int, float] | None, tuple[float, int, int, int] | None]  # Timeline.add_layer's compute, begin


@register_executor
class ExactGather(PipelinedExecutor):
    """Each layer's K/V assembled in device staging for the model's own attention (module docstring)."""

    name = "exact_gather"
    replaces_attention = False

    def __init__(self, store: KVStore, mover: ThreadMover, *, num_layers: int | None = None,
                 prefetch_depth: int | str = 1, timeline: Timeline | None = None, trace: Trace | None = None) -> None:
        if prefetch_depth != "auto" and (not isinstance(prefetch_depth, int) or prefetch_depth < 0):
            raise InvalidConfigError(f"prefetch_depth must be an int >= 0 or 'auto', got {prefetch_depth!r}.")
        prefetch_min: int = settings.get("prefetch_min")  # a bad TIERKV_PREFETCH_MIN: refused before any state
        super().__init__(store, mover, num_layers=num_layers, timeline=timeline, trace=trace)
        self.auto = prefetch_depth == "auto"
        # Layers whose read weighs less than this (setting prefetch_min; a read's weight: its bytes and
        # BLOCK_GATHER_BYTES per block) are not prefetched: handing a job to the mover (a thread switch and the GIL
        # shared with it) costs more than the copy it would overlap. On the 2-core CPU VM a decode step of 1-2 MiB
        # layers in a few hundred blocks ran 0.1-0.3x DynamicCache's step slower prefetched, of 4 MiB about even,
        # of 8 MiB and more 0.2-0.3x faster (docs/benchmarks.md, "Scale").
        self.prefetch_min = prefetch_min
        self.prefetch_depth: int = 1 if self.auto else int(prefetch_depth)
        self.auto_choices: list[dict] = []  # decisions of prefetch_depth="auto", oldest first
        self._auto_wait = AUTO_AFTER_STEPS  # decode steps left before the next "auto" decision
        self._resize = False  # the next _ensure_capacity reallocates (the depth changed)
        self._last_stop: dict[int, int] = {}
        self.capacity = 0  # tokens per staging buffer (whole blocks)
        self.batch = 0
        self.token_bytes = 0  # max over layers seen
        self._views: dict[tuple, torch.Tensor] = {}  # (buffer, layout, batch) -> typed staging view
        self.pending: dict[int, ColumnRead] = {}
        self._batches: dict[int, int] = {}  # layer -> rows of its last span (table edits clear it)
        self._next_cache: dict[tuple[int, int, int, bool], tuple[int, ...]] = {}  # see _next_layers
        self.current = -1  # staging buffer the model is attending over now
        self._handed: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # buffer -> the K and V the model got from it
        self.prefetch_disabled_logged = False

    # ---------------------------------------------------------------------------------- public
    @property
    def buffers(self) -> list[torch.Tensor]:
        return self.staging.buffers

    def step(self, span: Span, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gather(span)

    def gather(self, span: Span) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, H_kv, T, D]`` of tokens ``[span.start, span.stop)`` of ``span.layer`` (views of staging)."""
        entered = time.perf_counter()
        layer, stop = span.layer, span.stop
        new_pass = layer <= self.last_layer
        records: _Records = (None, None)  # the pass's records not yet given to the timeline (see _record_pass)
        if self.timeline is not None:
            records = self._record_pass(layer, stop, entered, new_pass)
        elif self.trace is not None and self._left_at is not None:
            self.trace.span(f"compute L{self.last_layer}", "compute", self._left_at, entered)
        try:
            kv, buffer, timings = self._gather(span)
        except BaseException:
            if self.timeline is not None and records != (None, None):
                self.timeline.add_layer(layer, (), *records)  # what was recorded before the read, as before
            raise
        if self.timeline is not None:
            self.timeline.add_layer(layer, timings, *records)  # one call per layer-step in the common case
        keys, values = kv[0], kv[1]
        self.current = buffer
        self._handed[buffer] = (weakref.ref(keys), weakref.ref(values))
        self._prefetch_next(layer)
        self._left_at = time.perf_counter()
        if self._accel.streams:  # the caller's stream reads staging (CUDA): the allocator must know
            self._accel.used(keys, values)
        return keys, values

    def _gather(self, span: Span) -> tuple[torch.Tensor, int, list[ReadTiming]]:
        """:meth:`gather`'s work: ``[2, B, H_kv, T, D]`` (a view of staging), the staging buffer and the timings of
        the synchronous read."""
        layer, start, stop, batch = span.layer, span.start, span.stop, span.batch
        self._see_layer(span)
        self._batches[layer] = batch
        bt = self.store.block_tokens
        first, end = start // bt, -(-stop // bt)
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
        offset, count = start - first * bt, stop - start
        return staging.narrow(3, offset, count), buffer, timings  # (narrow, then an int index: ~4 us, not ~9)

    def invalidate(self) -> None:
        try:
            self.wait_all()
            for prefetch in self.pending.values():
                self._consume(prefetch)
        finally:
            self.pending.clear()
            self._drop_all_ahead()
            self._batches.clear()
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

    def _paused(self) -> None:
        self._last_stop = {layer: self.store.seq_length(layer) for layer in self.store.layouts}

    def release_staging(self) -> None:
        self.invalidate()
        self._release()

    def close(self) -> None:
        self.release_staging()  # (the trace is written by the runtime's close(): a cache may close before any step)

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
        if tokens <= old_capacity:  # only the depth ("auto"), the batch or the token width changed: as many tokens
            capacity = old_capacity  # (growing them too would pass what min_device_bytes counts for the context)
        else:
            capacity = gather_capacity(tokens, self.store.block_tokens, old_capacity)
        if tokens > old_capacity or batch > old_batch or token_bytes > old_token_bytes:
            self._auto_wait = AUTO_AFTER_STEPS  # the staging grows: "auto" decides again on the new sizes
        self._resize = False
        self.invalidate()
        self._release()
        batch, token_bytes = max(batch, old_batch), max(token_bytes, old_token_bytes)
        per_buffer = batch * capacity * token_bytes
        depth = self.prefetch_depth
        if depth and not self.store.room_for_staging((depth + 1) * per_buffer, batch, self.num_layers or None):
            depth = 0  # the prefetch buffers would fit now but leave a later layer's new block no room
        try:
            self.staging.allocate(depth + 1, per_buffer)
        except BudgetTooSmallError:
            if depth == 0:
                raise
            depth = 0
            self.staging.allocate(1, per_buffer)  # no prefetch rather than no decoding
        if depth < self.prefetch_depth and not self.prefetch_disabled_logged:
            log.warning("tierkv: the device budget cannot hold prefetch buffers for %d tokens; prefetch is off "
                        "until gpu_gb is raised by about %s (%d bytes, the prefetch buffers)", tokens,
                        format_gb(self.prefetch_depth * per_buffer), self.prefetch_depth * per_buffer)
            self.prefetch_disabled_logged = True
        self.capacity, self.batch, self.token_bytes = capacity, batch, token_bytes

    def _release(self) -> None:
        self.staging.release()
        self._views.clear()
        self._handed.clear()  # views the model still holds keep their old buffer alive (torch counts them)
        self.capacity = self.batch = self.token_bytes = 0
        self.current = -1

    def _held(self) -> set[int]:
        """Buffers whose K/V the model still holds: a layer's K/V that later layers of the forward reuse."""
        return {buffer for buffer, (keys, values) in self._handed.items() if keys() is not None or values() is not None}

    def _busy(self, held: set[int] | None = None) -> set[int]:
        """Buffers a prefetch may not write now: the one attended over, those prefetches fill, those held
        (``held``: :meth:`_held`, if the caller has it)."""
        return {self.current} | {p.buffer for p in self.pending.values()} | (self._held() if held is None else held)

    def _free_buffer(self) -> int:
        """A buffer for a layer's gather: a free one, else one a prefetch fills (dropping it), else the one the
        previous layer attended over, else one more from the budget."""
        held = self._held()
        busy = self._busy(held)
        free = next((i for i in range(len(self.buffers)) if i not in busy), None)
        if free is not None:
            return free
        victim = next((p for p in self.pending.values() if p.buffer not in held and p.buffer != self.current), None)
        if victim is not None:
            victim.handle.settle()  # reuse its buffer: that prefetch is dropped, its layer will gather afresh
            del self.pending[victim.layer]
            self._consume(victim)
            return victim.buffer
        if 0 <= self.current < len(self.buffers) and self.current not in held:
            return self.current
        return self._another_buffer()

    def _another_buffer(self) -> int:
        """A buffer beside those the model holds K/V in: taken from the device budget."""
        try:
            self.staging.take(self.batch * self.capacity * self.token_bytes)
        except BudgetTooSmallError as exc:
            raise BudgetTooSmallError(
                f"{exc} Something still holds the K/V of {len(self._held())} earlier layers while this one attends, "
                "and each needs its own staging buffer: a model that shares KV across layers (Gemma 3n, Gemma 4; "
                "build the cache with config=model.config and a budget of at least TieredCache.min_device_bytes("
                "config, context), which counts them), or forwards run with autograd on whose outputs are kept (their "
                "graph holds the K/V they attended: call the model under torch.no_grad() or torch.inference_mode(), "
                "as generate() does).") from exc
        return len(self.buffers) - 1

    # -------------------------------------------------------------------------------- prefetch
    def _prefetch_next(self, layer: int) -> None:
        if len(self.buffers) < 2 or self.num_layers < 2:
            return
        for target in self._next_layers(layer, self.prefetch_depth):
            if target in self.pending or target not in self.store.layouts:
                continue
            busy = self._busy()
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
            out: list[int] = []
            target = self.next_layer(layer)
            while target is not None and target != layer and len(out) < count:
                out.append(target)
                target = self.next_layer(target)
            known = self._next_cache[key] = tuple(out)
        return known

    def _issue(self, layer: int, buffer: int) -> None:
        bt = self.store.block_tokens
        stop = self.store.lengths.get(layer, 0)  # seq_length's field: this runs for every layer of every step
        window = self.windows.get(layer)  # base.window_start, inline: this runs for every layer of every step
        start = 0 if window is None else max(0, stop - (window - 1))
        first, end = start // bt, -(-stop // bt)
        batch = self._batches.get(layer) or self.store.batch_size(layer)
        if (end - first) * bt > self.capacity or batch > self.batch or end <= first:
            return
        if (end - first) * batch * (self.store.layouts[layer].block_bytes + BLOCK_GATHER_BYTES) < self.prefetch_min:
            return  # read it when the layer comes: a hand-off to the mover would cost more than it overlaps
        plan = self.store.plan_read(layer, start, stop, access=False)  # the access is the layer's gather
        full = stop // bt - first  # columns that are full now: the tail (if partial) is read again later
        handle, timings = self._read_later(layer, plan, self._staging(buffer, layer, batch))
        self.pending[layer] = ColumnRead(layer, first, end - first, full, buffer, self.version, handle, timings)

    # ------------------------------------------------------------------------------- telemetry
    def _consume(self, prefetch: ColumnRead) -> None:
        """A prefetch left the pending set (used, dropped or invalidated): count what it moved."""
        if self.timeline is not None and prefetch.timings is not None:
            self.timeline.add_reads(prefetch.layer, prefetch.timings, sync=False)

    def _record_pass(self, layer: int, stop: int, entered: float, new_pass: bool) -> _Records:
        """The compute span of the layer before ``layer`` and, at a new pass, a new step. Returned as
        ``(compute, begin)`` for :meth:`~tierkv.stats.Timeline.add_layer` to record with the layer's reads when
        nothing records in between (no prefetch pending, no "auto" decision); recorded now otherwise."""
        timeline = self.timeline
        assert timeline is not None
        compute = None
        if self._left_at is not None:
            compute = (self.last_layer, entered - self._left_at)
            if self.trace is not None:
                self.trace.span(f"compute L{self.last_layer}", "compute", self._left_at, entered)
        new_tokens = stop - self._last_stop.get(layer, 0)
        self._last_stop[layer] = stop
        begin, choose = None, False
        if new_pass or timeline.current is None:
            if self.auto and timeline.current is not None and timeline.current.decode:
                self._auto_wait -= 1
            begin = (entered, new_tokens, stop, self.prefetch_depth)
            choose = self.auto and self._auto_wait <= 0 and self.layers_known
        else:
            current = timeline.current
            current.new_tokens = max(current.new_tokens, new_tokens)  # sliding layers may have dropped blocks
        if not self.pending and not choose:  # no stall, prefetch or choice records before the layer's reads
            return compute, begin
        if compute is not None:
            timeline.add_compute(*compute)
        if begin is not None:
            timeline.begin_step(*begin)
        if choose:
            self._auto_wait = 1 << 62  # until staging grows
            self._choose_depth()
        return None, None

    def _choose_depth(self) -> None:
        """``prefetch_depth="auto"``: set the depth from the last decode step's measured placement."""
        timeline = self.timeline
        layers = timeline.last_decode_layers() if timeline is not None else None
        if timeline is None or layers is None or not self.buffers or len(layers) != self.num_layers:
            self._auto_wait = 1
            return
        device, host = self.store.device, self.store.tiers[Tier.HOST]
        per_buffer = self.buffers[0].numel()
        tails = sum(layout.slot_bytes for layout in self.store.layouts.values()) * self.batch
        choice = choose_prefetch_depth(
            layers, timeline.profile, current=self.prefetch_depth, held_buffers=len(self.buffers),
            buffer_bytes=per_buffer, free_device_bytes=device.unallocated_bytes,
            max_buffers=(device.budget - tails) // per_buffer,
            free_host_bytes=host.budget - host.used_bytes)
        record = {"step": timeline.steps_seen - 1, **choice.as_dict()}
        self.auto_choices.append(record)
        del self.auto_choices[:-16]
        if choice.depth != self.prefetch_depth:
            log.info("tierkv: prefetch_depth auto: %d -> %d (%s)", self.prefetch_depth, choice.depth, choice.reason)
            self.prefetch_depth = choice.depth
            self._resize = True
