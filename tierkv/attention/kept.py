"""Blocks that sparse attention read in earlier decode steps, kept on the device per layer, so that a step
reads from the tiers only the blocks its selection did not hold yet.

Why: the selection needs the layer's query, so its read cannot start before the layer attends, and a read that
touches the disk waits for the disk's latency (about 1 ms for a few scattered blocks on this project's host,
against a few hundred microseconds for everything else a layer does). But selections are stable: on the demo
model at 16K tokens, 75-80% of a layer's selected blocks were selected the step before, and 90-97% within the
last few steps. Keeping each layer's recent selections turns most steps' reads into a device gather.

Per kept layer, a device buffer ``[2, B, H_kv, capacity · block_tokens, D]`` (reserved against the device
budget, like staging) and, per position, the block held there and the step it was last attended::

    held[b, k]   = selected block (b, k) sits at position pos[b, k]      (full blocks never change)
    read         = the others into the positions attended longest ago: one ReadPlan, one batched read per
                   tier; and the layer's last column, the open tail (it changes every step), copied straight
                   from its device slot (``KVStore.copy_open_tails``: no plan for the one block every step reads)
    staging      = kept[:, b, :, pos[b, k]]                               (one gather, in selection order)

Kept blocks are copies: the store's table is untouched and nothing is dropped from it. A table edit (crop, row
selection, reset) calls :meth:`KeptBlocks.clear`; block ids never repeat, so a kept block is never mistaken
for another one.

Memory: a layer keeps up to :data:`KEEP_FACTOR` times its selection's blocks (the previous selection and the
blocks that recently left it) but no more than its equal part of the :data:`KEEP_SHARE` of the device budget
that all kept layers may take together (so that the first layers do not take it all: at least its selection's),
or only its selection's, or nothing, whichever fits in what is left of that share and still leaves the device
room for every layer's open tail (``tierkv.staging.device_minimum``); a layer that is not kept reads its whole
selection every step (the behaviour without this module; speculation then guesses its previous selection).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tierkv.errors import BudgetTooSmallError
from tierkv.layout import BlockLayout
from tierkv.staging import device_minimum, open_tail_bytes
from tierkv.store import KVStore

# A kept layer holds up to KEEP_FACTOR times its selection's blocks; all kept layers together take at most
# KEEP_SHARE of the device budget. 3 / 0.7 was measured against these (docs/benchmarks.md, 2026-12-01 23:48):
# 40% fewer disk blocks per step and an 11% faster step at 32K, but the device tier left to the store then
# holds too little for policy="attention" to read less than lru (equal bytes at 16K, both budgets).
KEEP_FACTOR = 2
KEEP_SHARE = 0.5
_ROW_SHIFT = 40  # (row << 40) | block id: one sorted key per (row, block) for a single vectorized search


@dataclass(slots=True)
class Placed:
    """Where a step's selection sits in a kept layer, and what must be read for it.

    ``positions`` ``[B, K]``: the kept position of each selected block; ``targets`` ``[B, capacity]``: the grid
    column to read into each position (-1: none); ``reused``: selected blocks already held."""

    positions: np.ndarray
    targets: np.ndarray
    reused: int


class KeptLayer:
    """One layer's kept blocks: the device buffer and, per position, the block id (-1: none) and last use."""

    def __init__(self, buffer: torch.Tensor, batch: int, capacity: int) -> None:
        self.buffer = buffer  # flat uint8, reserved against the device budget
        self.ids = np.full((batch, capacity), -1, dtype=np.int64)  # [B, capacity]
        self.used = np.full((batch, capacity), -1, dtype=np.int64)  # [B, capacity]: step last attended

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def capacity(self) -> int:
        return self.ids.shape[1]

    def view(self, layout: BlockLayout) -> torch.Tensor:
        """The buffer as ``[2, B, H_kv, capacity · block_tokens, D]``."""
        tokens = self.capacity * layout.block_tokens
        nbytes = self.batch * tokens * layout.token_bytes
        return self.buffer[:nbytes].view(layout.dtype).view(2, self.batch, layout.kv_heads, tokens, layout.head_dim)

    def place(self, ids: np.ndarray, columns: np.ndarray, tail: np.ndarray, step: int) -> Placed:
        """Place a selection: ``ids`` / ``columns`` ``[B, K]`` (block ids and grid columns), ``tail`` ``[B, K]``
        flags the open tail (always read). Positions to be read are forgotten now (a failed read leaves them
        empty, never holding stale data); call :meth:`hold` once the read has landed."""
        batch, capacity = self.ids.shape
        offsets = np.arange(batch, dtype=np.int64)[:, None] << _ROW_SHIFT
        held = np.where(self.ids >= 0, self.ids | offsets, -1).ravel()  # [B·capacity], -1 sorts first
        order = np.argsort(held, kind="stable")
        wanted = (ids | offsets).ravel()  # [B·K]
        found = np.minimum(np.searchsorted(held[order], wanted), held.size - 1)
        flat = order[found]  # flat position of the match (if any)
        match = (held[flat] == wanted).reshape(ids.shape)  # [B, K]
        positions = np.where(match, flat.reshape(ids.shape) % capacity, 0)
        stale = match & tail  # the open tail is never held (it changes), unless a table edit made it the tail
        self.ids[np.nonzero(stale)[0], positions[stale]] = -1
        hit = match & ~tail
        # the others go to the positions not hit now: empty ones first, then those attended longest ago
        keep = np.zeros((batch, capacity), dtype=bool)
        keep[np.nonzero(hit)[0], positions[hit]] = True
        rank = np.where(keep, np.iinfo(np.int64).max, self.used)
        free = np.argsort(rank, axis=1, kind="stable")  # [B, capacity]
        miss = ~hit
        nth = np.cumsum(miss, axis=1) - 1  # the j-th miss of a row takes that row's j-th free position
        rows = np.nonzero(miss)[0]
        positions[miss] = free[rows, nth[miss]]
        targets = np.full((batch, capacity), -1, dtype=np.int64)
        targets[rows, positions[miss]] = columns[miss]
        self.ids[rows, positions[miss]] = -1
        self.used[np.arange(batch)[:, None], positions] = step
        return Placed(positions, targets, int(np.count_nonzero(hit)))

    def hold(self, placed: Placed, ids: np.ndarray, tail: np.ndarray) -> None:
        """The read of ``placed`` landed: its positions hold their blocks (not the open tail: it changes)."""
        stored = ~tail & (placed.targets[np.arange(self.batch)[:, None], placed.positions] >= 0)
        self.ids[np.nonzero(stored)[0], placed.positions[stored]] = ids[stored]

    def gather(self, layout: BlockLayout, positions: np.ndarray, dest: torch.Tensor) -> None:
        """Copy the blocks at ``positions`` ``[B, K]`` into ``dest`` ``[2, B, H_kv, K · bt, D]`` (contiguous), in
        order: one ``index_select`` per row and K/V straight into ``dest`` (no temporary: on the CPU a large
        one costs fresh pages every step)."""
        batch, count = positions.shape
        source = self.view(layout).unflatten(3, (self.capacity, -1))  # [2, B, H_kv, capacity, bt, D]
        target = dest.unflatten(3, (count, -1))  # [2, B, H_kv, K, bt, D]
        index = torch.from_numpy(positions).to(dest.device)
        for row in range(batch):
            for part in range(2):  # K, V
                torch.index_select(source[part, row], 1, index[row], out=target[part, row])


class KeptBlocks:
    """The kept layers of one sparse executor, and their device reservation."""

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.layers: dict[int, KeptLayer] = {}
        self.refused: dict[int, int] = {}  # layer -> batch size whose selection did not fit the share
        self.reserved = 0

    def layer(self, layer: int, batch: int, count: int) -> KeptLayer | None:
        """The kept layer for a selection of ``count`` blocks per row (allocated, or grown, on first need)."""
        kept = self.layers.get(layer)
        if kept is not None and kept.batch == batch and kept.capacity >= count:
            return kept
        if self.refused.get(layer) == batch:
            return None  # it did not fit (a larger selection would not either)
        self._drop(layer)
        store = self.store
        layout = store.layouts[layer]
        block_bytes = batch * store.block_tokens * layout.token_bytes
        share = int(store.device.budget * KEEP_SHARE) - self.reserved
        tails = open_tail_bytes(len(store.layouts), batch, layout.slot_bytes)  # must stay possible beside it
        fair = int(store.device.budget * KEEP_SHARE) // (len(store.layouts) * block_bytes)  # blocks per layer
        for capacity in dict.fromkeys((min(KEEP_FACTOR * count, max(count, fair)), count)):
            nbytes = capacity * block_bytes
            if nbytes > share or device_minimum(store.device.reserved + nbytes, tails) > store.device.budget:
                continue
            try:
                self.store.reserve_device(nbytes)
            except BudgetTooSmallError:
                break
            self.reserved += nbytes
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.store.device.device)
            self.layers[layer] = kept = KeptLayer(buffer, batch, capacity)
            return kept
        self.refused[layer] = batch
        return None

    def clear(self, layer: int | None = None) -> None:
        """Forget what is held (a table edit): the buffers stay reserved for the next steps."""
        for index, kept in self.layers.items():
            if layer is None or index == layer:
                kept.ids.fill(-1)
                kept.used.fill(-1)

    def _drop(self, layer: int) -> None:
        kept = self.layers.pop(layer, None)
        if kept is not None:
            self.store.device.unreserve(kept.buffer.numel())
            self.reserved -= kept.buffer.numel()

    def release(self) -> None:
        for layer in list(self.layers):
            self._drop(layer)
        self.refused.clear()
