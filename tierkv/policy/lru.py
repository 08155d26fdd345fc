"""Least recently used: demote the block read longest ago; ties go to the oldest block.

In exact decoding all blocks of a layer are read every step, so LRU reduces to FIFO by creation over the
layers read longest ago — the oldest blocks stream from lower tiers and the newest stay resident, spread
evenly over the layers. That is stable (nothing ping-pongs), which is what matters in exact mode; recency
starts to pay off when access is skewed (sparse attention, prefix reuse).

The index: per (tier, slot size, layer) a sorted list of ``(tick, id)``, least recently used first, and per
block id the tick it was last read on its own (a numpy array). A whole-layer read is O(1): it sets the layer's
tick, which every block of the layer then shares. A read of named blocks (sparse attention, a layer-step's
selection) is one vectorized assignment into the tick array, no Python per block; a block's entry in the
sorted list keeps the tick it was placed with, which can only be too old, so :meth:`victims` walks each list
from its oldest end and re-places an entry whose block was read since (a lazy increase-key, as in
:mod:`tierkv.policy.attention`) before it answers. ``victims`` merges the layers' heads with a heap keyed on
(effective tick, block id), so it costs O(n log layers) plus the re-placed entries, not a scan.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator

import numpy as np
from sortedcontainers import SortedList

from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Block, Tier
from tierkv.policy.base import Policy, register_policy


@register_policy
class LRUPolicy(Policy):
    name = "lru"

    def __init__(self) -> None:
        self._index: dict[tuple[Tier, int], dict[int, SortedList]] = {}  # (tier, slot) -> layer -> (tick, id)
        self._blocks: dict[int, Block] = {}  # id -> block, for the indexed (live, unpinned) ones
        self._placed: dict[int, tuple[Tier, int]] = {}  # id -> the tier and tick of its entry in the index
        self._tick = np.zeros(64, dtype=np.int64)  # block id -> tick it was last read on its own (or inserted)
        self._layer_tick: dict[int, int] = {}
        self._pinned: set[int] = set()

    def indexed(self) -> Iterator[tuple[Tier, int, int, Block]]:
        """Every indexed block as ``(tier, slot size, layer, block)`` (for consistency checks)."""
        for (tier, slot_bytes), layers in self._index.items():
            for layer, entries in layers.items():
                for _, block_id in entries:
                    yield tier, slot_bytes, layer, self._blocks[block_id]

    def on_insert(self, block: Block, tick: int) -> None:
        if block.id >= self._tick.size:
            grown = np.zeros(max(block.id + 1, 2 * self._tick.size), dtype=np.int64)
            grown[: self._tick.size] = self._tick
            self._tick = grown
        self._tick[block.id] = tick
        self._unplace(block)  # (a block is inserted once; this keeps the index exact if it were again)
        self._place(block)

    def on_access(self, layer: int, tick: int, block_ids: Iterable[int] | None = None) -> None:
        if block_ids is None:
            self._layer_tick[layer] = tick
            return
        ids = np.asarray(block_ids if isinstance(block_ids, np.ndarray) else list(block_ids), dtype=np.int64)
        self._tick[ids[ids < self._tick.size]] = tick  # ticks never go back: the entries are re-placed lazily

    def on_release(self, block: Block) -> None:
        self._pinned.discard(block.id)
        self._unplace(block)

    def on_move(self, block: Block, old_tier: Tier) -> None:
        self._unplace(block)
        if block.id not in self._pinned:
            self._place(block)

    def pin(self, block: Block) -> None:
        self._pinned.add(block.id)
        self._unplace(block)

    def unpin(self, block: Block) -> None:
        if block.id in self._pinned:
            self._pinned.discard(block.id)
            self._place(block)

    def victims(self, tier: Tier, slot_bytes: int, n: int, exclude: Collection[int] = ()) -> list[Block]:
        layers = self._index.get((tier, slot_bytes), {})
        heads: list[tuple[int, int, int, Iterator[Block], Block]] = []
        for layer, entries in layers.items():
            self._push(heads, layer, self._oldest_first(entries, exclude))
        chosen: list[Block] = []
        while heads and len(chosen) < n:
            _, _, layer, it, block = heapq.heappop(heads)
            chosen.append(block)
            self._push(heads, layer, it)
        return chosen

    # ----------------------------------------------------------------------------------- index
    def _oldest_first(self, entries: SortedList, exclude: Collection[int]) -> Iterator[Block]:
        """A layer's blocks, least recently read first; an entry whose block was read since it was placed is
        re-placed by its tick now (it moves towards the newest end, where the walk meets it again)."""
        at = 0
        while at < len(entries):
            tick, block_id = entries[at]
            current = int(self._tick[block_id])
            if current != tick:
                block = self._blocks[block_id]
                with deferred_interrupts():  # never half re-placed: the index holds every unpinned block once
                    entries.remove((tick, block_id))
                    entries.add((current, block_id))
                    self._placed[block_id] = (block.tier, current)
                continue
            at += 1
            if block_id not in exclude:
                yield self._blocks[block_id]

    def _place(self, block: Block) -> None:
        """Index the block. Its entry goes in last, and :meth:`_unplace` takes it out first, so an interrupt
        between any two lines (a crop's copy is inserted outside a deferred commit) never leaves an entry
        whose block is unknown, nor one that a later ``_unplace`` cannot find."""
        tick = int(self._tick[block.id])
        self._blocks[block.id] = block
        self._placed[block.id] = (block.tier, tick)
        layers = self._index.setdefault((block.tier, block.slot_bytes), {})
        layers.setdefault(block.layer, SortedList()).add((tick, block.id))

    def _unplace(self, block: Block) -> None:
        """Take the block's entry out of the index, wherever it was placed (a no-op if it is not indexed)."""
        placed = self._placed.get(block.id)
        if placed is not None:
            tier, tick = placed
            entries = self._index.get((tier, block.slot_bytes), {}).get(block.layer)
            if entries is not None:
                entries.discard((tick, block.id))
        self._placed.pop(block.id, None)
        self._blocks.pop(block.id, None)

    def _push(self, heads: list, layer: int, it: Iterator[Block]) -> None:
        block = next(it, None)
        if block is not None:
            tick = max(int(self._tick[block.id]), self._layer_tick.get(layer, 0))
            heapq.heappush(heads, (tick, block.id, layer, it, block))
