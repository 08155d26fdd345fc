"""Exact gather: assemble each layer's K/V on the device from all tiers, prefetching layers ahead.

The model's own attention (eager, sdpa, flash) then runs unchanged on the assembled tensors, so results
equal a plain in-memory cache. Staging buffers live in device memory counted against the device budget:
``prefetch_depth + 1`` of them, each big enough for one layer's K/V of the whole batch::

    staging[i]: [2, B, H_kv, capacity, D]   (K = [0], V = [1]; capacity grows by 25% steps, block aligned)

While layer L attends over staging[a], the mover fills staging[b] with every block layer L+1 already had.
When layer L+1's ``update`` arrives, only its new tokens (and anything appended since) are copied on top.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierkv.errors import BudgetTooSmallError
from tierkv.mover import MoveHandle, ThreadMover
from tierkv.store import KVStore

log = logging.getLogger("tierkv")

GROWTH = 1.25


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Layer ``layer`` tokens ``[start, start + count)`` are on their way into staging buffer ``buffer``."""

    layer: int
    buffer: int
    start: int
    count: int
    version: int
    handle: MoveHandle


class ExactGather:
    def __init__(self, store: KVStore, mover: ThreadMover, prefetch_depth: int = 1) -> None:
        self.store = store
        self.mover = mover
        self.prefetch_depth = prefetch_depth
        self.capacity = 0  # tokens per staging buffer
        self.batch = 0
        self.token_bytes = 0  # max over layers seen
        self.buffers: list[torch.Tensor] = []
        self.pending: dict[int, Prefetch] = {}
        self.current = -1  # staging buffer the model is attending over now
        self.version = 0  # bumped by table edits that invalidate staged data
        self.num_layers = 0
        self.layers_known = False
        self.last_layer = -1
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self.prefetch_disabled_logged = False
        self.stall_s = 0.0  # time the model waited for prefetches to land
        self.start_of: Callable[[int], int] = lambda layer: 0  # first stored token a layer's attention reads
        store.barrier = self.wait_all

    # ---------------------------------------------------------------------------------- public
    def gather(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[B, H_kv, T, D]`` of tokens ``[start, seq_length)`` of ``layer`` (views of staging)."""
        if layer == 0 and self.num_layers > 1 and self.last_layer == self.num_layers - 1:
            self.layers_known = True  # a full pass was seen: wrapping prefetch to layer 0 is now safe
        self.num_layers = max(self.num_layers, layer + 1)
        self.last_layer = layer
        stop = self.store.seq_length(layer)
        layout = self.store.layouts[layer]
        batch = self.store.batch_size(layer)
        prefetched = self.pending.pop(layer, None)
        if prefetched is not None:
            waited_from = time.perf_counter()
            prefetched.handle.wait()
            self.stall_s += time.perf_counter() - waited_from
        self._ensure_capacity(batch, stop - start, layout.token_bytes)
        if prefetched is not None and prefetched.start == start and prefetched.version == self.version \
                and prefetched.count <= stop - start and prefetched.buffer < len(self.buffers):
            buffer, done = prefetched.buffer, prefetched.count
            self.prefetch_hits += 1
        else:
            buffer, done = self._free_buffer(), 0
            self.prefetch_misses += prefetched is not None
        staging = self._staging(buffer, layer, batch)
        self.store.read_into(layer, self.store.plan_read(layer, start + done, stop), staging[..., done:, :])
        self.current = buffer
        self._prefetch_next(layer)
        count = stop - start
        return staging[0, :, :, :count], staging[1, :, :, :count]

    def invalidate(self) -> None:
        """Table edits (reorder, crop, reset) make staged data stale."""
        self.wait_all()
        self.pending.clear()
        self.version += 1

    def wait_all(self) -> None:
        for prefetch in self.pending.values():
            prefetch.handle.wait()

    def close(self) -> None:
        self.invalidate()
        self._release()

    # --------------------------------------------------------------------------------- staging
    def _round(self, tokens: int) -> int:
        return round_to_blocks(tokens, self.store.block_tokens)

    def _staging(self, buffer: int, layer: int, batch: int) -> torch.Tensor:
        layout = self.store.layouts[layer]
        nbytes = batch * self.capacity * layout.token_bytes
        flat = self.buffers[buffer][:nbytes].view(layout.dtype)
        return flat.view(2, batch, layout.kv_heads, self.capacity, layout.head_dim)

    def _ensure_capacity(self, batch: int, tokens: int, token_bytes: int) -> None:
        if tokens <= self.capacity and batch <= self.batch and token_bytes <= self.token_bytes:
            return
        self.invalidate()
        self._release()
        capacity = self._round(max(tokens, int(self.capacity * GROWTH)))
        batch, token_bytes = max(batch, self.batch), max(token_bytes, self.token_bytes)
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
        self.buffers = [torch.empty(per_buffer, dtype=torch.uint8, device=device) for _ in range(count)]
        self.capacity, self.batch, self.token_bytes = capacity, batch, token_bytes

    def _release(self) -> None:
        if self.buffers:
            self.store.device.unreserve(sum(buffer.numel() for buffer in self.buffers))
        self.buffers = []
        self.capacity = self.batch = self.token_bytes = 0
        self.current = -1

    def _free_buffer(self) -> int:
        busy = {self.current} | {p.buffer for p in self.pending.values()}
        free = next((i for i in range(len(self.buffers)) if i not in busy), None)
        if free is not None:
            return free
        victim = next(p for p in self.pending.values() if p.buffer != self.current) if self.pending else None
        if victim is None:
            return (self.current + 1) % len(self.buffers)
        victim.handle.wait()  # reuse its buffer: that prefetch is dropped, its layer will gather afresh
        del self.pending[victim.layer]
        return victim.buffer

    # -------------------------------------------------------------------------------- prefetch
    def _prefetch_next(self, layer: int) -> None:
        if len(self.buffers) < 2 or self.num_layers < 2:
            return
        for ahead in range(1, self.prefetch_depth + 1):
            target = (layer + ahead) % self.num_layers
            if target <= layer and not self.layers_known:
                return  # the layer count is not known yet: wrapping could target a layer that is not next
            if target in self.pending or target == layer or target not in self.store.layouts:
                continue
            busy = {self.current} | {p.buffer for p in self.pending.values()}
            free = [i for i in range(len(self.buffers)) if i not in busy]
            if not free:
                return
            self._issue(target, free[0])

    def _issue(self, layer: int, buffer: int) -> None:
        start = self.start_of(layer)
        stop = self.store.seq_length(layer)
        batch = self.store.batch_size(layer)
        if stop - start > self.capacity or batch > self.batch:
            return
        staging = self._staging(buffer, layer, batch)
        segments = self.store.plan_read(layer, start, stop)
        handle = self.mover.submit(lambda: self.store.read_into(layer, segments, staging))
        self.pending[layer] = Prefetch(layer, buffer, start, stop - start, self.version, handle)


def round_to_blocks(tokens: int, block_tokens: int) -> int:
    return max(block_tokens, math.ceil(tokens / block_tokens) * block_tokens)


def staging_bytes(batch: int, tokens: int, token_bytes: int, block_tokens: int, prefetch_depth: int) -> int:
    """Device bytes of the staging area for ``tokens`` of context: one buffer per prefetch level, plus one."""
    return (prefetch_depth + 1) * batch * round_to_blocks(tokens, block_tokens) * token_bytes
