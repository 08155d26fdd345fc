"""The executor protocol, its registry, and what every executor shares: staging, column reads, prefetch.

An executor decides how a layer attends over KV that lives in several tiers (exact gather, streaming, sparse,
later split). The cache layer (:class:`tierkv.hf.layer.TieredLayer`) appends a step's tokens to the store, then
hands the active executor one immutable :class:`Span` and the step's keys and values::

    keys, values = executor.step(span, keys, values)      # what the model's attention function gets
    out, lse = executor.attend(span, query, mask, scaling, softcap)   # executors that replace the attention function

Executors are built by name from :data:`EXECUTORS` with everything they need::

    executor = EXECUTORS["exact_gather"](store, mover, num_layers=..., timeline=..., trace=..., **options)

Adding an executor: subclass :class:`PipelinedExecutor`, set ``name`` (and ``replaces_attention``), decorate it
with :func:`register_executor`, hold device memory only through its :class:`~tierkv.staging.Staging` (the cache
calls :meth:`~PipelinedExecutor.release_staging` when a mode without it takes over), and add it to
``tests/test_executor_contract.py``'s ``engage``. A cache runs it inside a :class:`tierkv.hf.runtime.Mode`
(which registered executor takes multi-token steps, which one-token steps) that an
:class:`tierkv.hf.attention.Engagement` pushes for a ``with`` block, as ``cache.streaming()`` and
``cache.sparse()`` do.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from tierkv import accel
from tierkv.attention.timed_read import resolve_cuda_events, timed_read
from tierkv.bandwidth import DISK_READ_AHEAD
from tierkv.blocks import Tier
from tierkv.errors import TierKVError
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.staging import Staging
from tierkv.stats import ReadTiming, Timeline, Trace
from tierkv.store import KVStore, ReadPlan
from tierkv.tiers.base import PendingRead


@dataclass(frozen=True, slots=True)
class Span:
    """What one layer attends over in one step, after the step's tokens were appended to the store.

    ``start``: the first stored token attended (a sliding window starts later); ``stop``: the stored tokens,
    this step's included; ``new_tokens``: this step's; ``batch``: rows; ``window``: the layer's sliding window
    (None: full attention), from which executors predict later steps' starts for prefetch; ``context``: the
    layer's sequence length, dropped tokens included (what a fractional sparse budget is a fraction of).
    """

    layer: int
    start: int
    stop: int
    new_tokens: int
    batch: int
    window: int | None = None
    context: int = 0

    @classmethod
    def of(cls, store: KVStore, layer: int, start: int = 0, new_tokens: int = 0) -> Span:
        """The span of ``layer`` from ``start`` to everything the store holds (full attention)."""
        stop = store.seq_length(layer)
        return cls(layer, start, stop, new_tokens, store.batch_size(layer), None, stop - start)


def window_start(stored: int, window: int | None) -> int:
    """The first stored token a layer of ``stored`` tokens attends at its next one-token step (HF's sliding
    semantics: the window holds ``window - 1`` past tokens and the new one)."""
    return 0 if window is None else max(0, stored - (window - 1))


class Executor(Protocol):
    """What the cache layer needs of every executor."""

    name: ClassVar[str]
    replaces_attention: ClassVar[bool]  # True: the model's attention function calls attend() (streaming, sparse)
    approximate: ClassVar[bool]  # True: its steps' outputs, so the next layers' K/V, differ from full attention's
    prefetch_hits: int
    prefetch_misses: int
    stall_s: float
    read_ahead_hits: int

    def step(self, span: Span, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V ``[B, H_kv, T, D]`` the model's attention function gets for ``span`` (the step's own
        ``keys``/``values`` already appended to the store)."""

    def attend(self, span: Span, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query`` ``[B, H_q, q, D]`` over ``span``: the softmax-normalised output ``[B, H_q, q, D]``
        and its log-sum-exp ``[B, H_q, q]``, fp32 on the query's device (:mod:`tierkv.attention.lse`'s convention:
        the layer folds in what the model adds to the softmax, such as attention sinks, then returns the output in
        the model's layout)."""

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

    def release_staging(self) -> None:
        """Another executor takes over: give the device memory staged for this one back to the budget."""

    def close(self) -> None: ...


EXECUTORS: dict[str, type[PipelinedExecutor]] = {}


def register_executor(cls: type[PipelinedExecutor]) -> type[PipelinedExecutor]:
    EXECUTORS[cls.name] = cls
    return cls


READ_AHEAD_BYTES = 1 << 30
"""At most this many bytes of disk reads ahead in flight (one is always allowed), so long layers read fewer
layers ahead. Each holds a host bounce buffer of at most ``tierkv.tiers.disk.BOUNCE_BYTES`` (a larger read
runs in rounds), so their memory is also bounded by ``(READ_AHEAD + 2) * BOUNCE_BYTES`` for exact gather
(:attr:`PipelinedExecutor.ahead_buffers` names; docs/reliability.md, "Memory"). Split's two reads ring through
three of those buffers each, the same ``READ_AHEAD + 2`` names
(:meth:`~tierkv.attention.split.SplitAttention.ring`)."""

READ_AHEAD = DISK_READ_AHEAD
"""Disk reads submitted ahead of the reads that will use them (see ``PipelinedExecutor._read_ahead``); each
holds a host bounce buffer of one read's disk bytes until the read that uses it has copied it out. The
bandwidth model's number, so the forecast pipelines the disk as the runtime does."""


@dataclass(slots=True)
class DiskAhead:
    """The disk part of ``plan``, submitted early into the scratch buffer ``purpose``."""

    plan: ReadPlan
    pending: PendingRead
    purpose: str
    nbytes: int  # its disk bytes (the size of the host buffer it holds)


@dataclass(frozen=True, slots=True)
class ColumnRead:
    """Block columns ``[first, first + columns)`` of ``layer`` on their way into staging buffer ``buffer``; the
    first ``full`` of them were full when planned (immutable since, unless the table is edited: ``version``)."""

    layer: int
    first: int
    columns: int
    full: int
    buffer: int
    version: int
    handle: MoveHandle
    timings: list[ReadTiming] | None = field(default=None, compare=False)  # filled by the mover (telemetry on)


class PipelinedExecutor:
    """Shared state of executors that prefetch layer by layer on a mover.

    ``num_layers`` is known up front when the cache was built from a config, else learnt from the first full
    pass — until then prefetch never wraps to layer 0. Each layer's sliding window is learnt from its spans
    (:func:`window_start` predicts where its next step starts). The executor registers with the store as a
    reader, so the store's barrier waits for its reads; its device memory is its :attr:`staging`.
    """

    name: ClassVar[str] = ""
    replaces_attention: ClassVar[bool] = True
    approximate: ClassVar[bool] = False
    read_ahead = READ_AHEAD
    """Disk reads this executor keeps submitted ahead (each holds a bounce buffer: :attr:`ahead_buffers` names)."""

    @property
    def ahead_buffers(self) -> int:
        """Host buffers (``ahead0`` ..) this executor's reads ahead may hold at once: ``read_ahead + 2`` (a read
        ahead claimed by a prefetch keeps its buffer until the mover's job copied it out)."""
        return self.read_ahead + 2

    def __init__(self, store: KVStore, mover: ThreadMover, *, num_layers: int | None = None,
                 timeline: Timeline | None = None, trace: Trace | None = None) -> None:
        self.store = store
        self.mover = mover
        self.staging = Staging(store)
        self.windows: dict[int, int | None] = {}  # layer -> its sliding window, from the spans seen
        self.num_layers = num_layers or 0
        self.layers_known = num_layers is not None
        self.timeline = timeline
        self.trace = trace
        self._accel = accel.backend(store.device.device)  # CUDA, its stand-in, or none (tierkv.accel)
        if timeline is not None and self._accel.streams:
            timeline.resolve = resolve_cuda_events
        self.last_layer = -1
        self._left_at: float | None = None  # telemetry: when the last layer's step returned to the model
        self.version = 0  # bumped by table edits that invalidate staged data
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.stall_s = 0.0  # time the model waited for prefetches to land
        self.read_ahead_hits = 0  # reads whose disk part was already in flight (see _read_ahead)
        self._disk_ahead: dict[tuple[int, int], DiskAhead] = {}  # (layer, first column) -> its disk read in flight
        self._buffer_users: dict[str, DiskAhead | MoveHandle] = {}  # read-ahead buffer -> who holds it
        store.add_reader(self)

    # ------------------------------------------------------------------------------------ protocol
    def step(self, span: Span, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Executors that replace the attention function hand the step's own K/V to the model (it passes them
        back to :meth:`attend`, which reads everything else from the store)."""
        return keys, values

    def attend(self, span: Span, query: torch.Tensor, mask: torch.Tensor | None, scaling: float,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise TierKVError(f"the {self.name} executor gathers K/V for the model's own attention; it attends nothing.")

    def pause_telemetry(self) -> None:
        """Another executor takes over: the step in progress ends here (the gap is neither one's compute), and the
        read-ahead buffers are given up (:meth:`_give_up_ahead_buffers`)."""
        if self.timeline is not None:
            self.timeline.end_step(time.perf_counter())
        self._left_at = None
        self.last_layer = -1
        self._paused()
        self._give_up_ahead_buffers()

    def _give_up_ahead_buffers(self) -> None:
        """The read-ahead buffers (``ahead0`` ..) are the calling thread's, shared by name with the executor that
        takes over (a mode's prefill and decode executors): drop the reads ahead and wait for the mover's jobs still
        copying out of one, so its reads neither overwrite a read ahead this executor would later use (a
        multi-token step between decode steps: its reads land where the next decode step's read ahead waited) nor
        land under a copy in progress."""
        self._drop_all_ahead()
        for name, user in list(self._buffer_users.items()):
            if isinstance(user, MoveHandle):
                wait_quietly(user)
                del self._buffer_users[name]

    def _paused(self) -> None:
        """What else an executor forgets when its telemetry pauses."""

    def invalidate(self) -> None:
        """Table edits (crop, reorder, reset, a rollback) make staged data stale: forget it."""
        raise NotImplementedError

    def reset(self) -> None:
        """The store was reset: forget staged data and per-sequence telemetry state."""
        raise NotImplementedError

    def drop(self, layer: int) -> None:
        """Forget ``layer``'s prefetch (its token positions shifted: a sliding window dropped blocks)."""
        raise NotImplementedError

    def wait_all(self) -> None:
        """The store's barrier: no read of this executor is still in flight (raises nothing)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release everything (staging, reads in flight); the executor is not used again."""
        raise NotImplementedError

    def release_staging(self) -> None:
        self.invalidate()
        self.staging.release()

    # ------------------------------------------------------------------------------------ layers
    @property
    def timed(self) -> bool:
        return self.timeline is not None or self.trace is not None

    def start_of(self, layer: int) -> int:
        """The first stored token ``layer`` attends at its next one-token step (a prediction, for prefetch)."""
        return window_start(self.store.seq_length(layer), self.windows.get(layer))

    def next_layer(self, layer: int) -> int | None:
        """The layer after ``layer`` in pass order: layer 0 after the last, once the layer count is known
        (before that the next attention may not be layer 0: None)."""
        target = layer + 1
        if target >= self.num_layers:
            if not self.layers_known:
                return None
            target = 0
        return target

    def _see_layer(self, span: Span) -> None:
        """Called as each layer starts: learns the layer count from the first full pass, and its window."""
        layer = span.layer
        if layer == 0 and self.num_layers > 1 and self.last_layer == self.num_layers - 1:
            self.layers_known = True  # a full pass was seen: wrapping prefetch to layer 0 is now safe
        self.num_layers = max(self.num_layers, layer + 1)
        self.last_layer = layer
        self.windows[layer] = span.window

    def _read_now(self, layer: int, plan: ReadPlan, dest: torch.Tensor, claim: bool = True) -> list[ReadTiming]:
        """A synchronous read on the caller's thread (a miss, or a top-up of a prefetch; ``claim`` False: a read
        no disk read ahead was started for)."""
        timings: list[ReadTiming] = []
        ahead = self._claim_ahead(layer, plan) if claim else None
        try:
            if not self.timed:
                self.store.read_into(layer, plan, dest, ahead=ahead.pending if ahead else None)
            else:
                timed_read(self.store, layer, plan, dest, timings, accel=self._accel, trace=self.trace,
                           category="read", ahead=ahead.pending if ahead else None)
        finally:
            if ahead is not None:
                del self._buffer_users[ahead.purpose]
        return timings

    def _read_later(self, layer: int, plan: ReadPlan, dest: torch.Tensor) -> tuple[MoveHandle, list[ReadTiming] | None]:
        """A read on the mover; its timings list fills when the job runs (None when telemetry is off)."""
        claimed = self._claim_ahead(layer, plan)
        ahead = claimed.pending if claimed is not None else None
        timings: list[ReadTiming] | None = None
        if not self.timed:
            handle = self.mover.submit(lambda: self.store.read_into(layer, plan, dest, ahead=ahead))
        else:
            timings = []
            handle = self.mover.submit(lambda: timed_read(self.store, layer, plan, dest, timings, accel=self._accel,
                                                          trace=self.trace, category="prefetch", ahead=ahead))
        if claimed is not None:
            self._buffer_users[claimed.purpose] = handle  # its buffer is busy until the job has copied it out
        return handle, timings

    # ---------------------------------------------------------------------------- disk read-ahead
    def _read_ahead(self, targets: Iterable[tuple[int, int, int]]) -> None:
        """Submit the disk part of each ``(layer, start, stop)`` read that will come soon, so the disk engine
        always has work queued (it reads on its own threads) while the mover copies and the model computes.
        A read ahead is used only by a read of the identical plan (plans change with any table edit)."""
        if Tier.DISK not in self.store.tiers:
            return
        for layer, start, stop in targets:
            if stop <= start or layer not in self.store.layouts:
                continue
            plan = self.store.plan_read(layer, start, stop, access=False)
            key = (layer, plan.first)
            held = self._disk_ahead.get(key)
            if held is not None and held.plan is plan:
                continue
            if held is not None:
                self._drop_ahead_read(key)
            if Tier.DISK not in plan.tiers:
                continue
            nbytes = _disk_bytes(self.store, layer, plan)
            if self._disk_ahead and sum(e.nbytes for e in self._disk_ahead.values()) + nbytes > READ_AHEAD_BYTES:
                return  # enough is in flight: each read ahead holds a host buffer of its disk bytes
            purpose = self._free_buffer_name()
            if purpose is None:
                return
            pending = self._submit_ahead(layer, plan, purpose)
            if pending is None:  # nothing of the plan is on disk any more
                continue
            entry = DiskAhead(plan, pending, purpose, nbytes)
            self._disk_ahead[key] = entry
            self._buffer_users[purpose] = entry

    def _submit_ahead(self, layer: int, plan: ReadPlan, purpose: str) -> PendingRead | None:
        """Submit the disk part of ``plan`` into the buffer ``purpose`` (None: nothing of it is on disk): a read
        through one bounce buffer (:meth:`KVStore.read_ahead`)."""
        return self.store.read_ahead(layer, plan, purpose)

    def _claim_ahead(self, layer: int, plan: ReadPlan) -> DiskAhead | None:
        entry = self._disk_ahead.pop((layer, plan.first), None)
        if entry is not None and entry.plan is not plan:
            entry.pending.settle()
            del self._buffer_users[entry.purpose]
            return None
        self.read_ahead_hits += entry is not None
        return entry

    def _drop_ahead_read(self, key: tuple[int, int]) -> None:
        entry = self._disk_ahead.pop(key)
        entry.pending.settle()
        del self._buffer_users[entry.purpose]

    def _drop_all_ahead(self) -> None:
        for key in list(self._disk_ahead):
            self._drop_ahead_read(key)

    def _settle_ahead(self) -> None:
        """Barrier: no read ahead is still landing (they stay usable if their plans do not change)."""
        for entry in self._disk_ahead.values():
            entry.pending.settle()

    def _free_buffer_name(self) -> str | None:
        for index in range(self.ahead_buffers):
            name = f"ahead{index}"
            user = self._buffer_users.get(name)
            if isinstance(user, MoveHandle) and user.done():
                del self._buffer_users[name]
                user = None
            if user is None:
                return name
        return None

    def _stalled(self, since: float, layer: int) -> float:
        """The model waited from ``since`` until now for data of ``layer``: stall, not compute."""
        now = time.perf_counter()
        self.stall_s += now - since
        if self.timeline is not None:
            self.timeline.add_stall(now - since)
        if self.trace is not None:
            self.trace.span(f"wait L{layer}", "stall", since, now)
        return now - since


def _disk_bytes(store: KVStore, layer: int, plan: ReadPlan) -> int:
    return sum(part.blocks for part in plan.parts if part.tier == Tier.DISK) * store.layouts[layer].slot_bytes


def wait_quietly(handle: MoveHandle) -> bool:
    """Wait for a prefetch; False if it failed (a miss: the synchronous read then reports the error)."""
    try:
        handle.wait()
    except Exception:  # noqa: BLE001
        return False
    return True

