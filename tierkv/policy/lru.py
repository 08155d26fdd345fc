"""Least recently used: demote the block read longest ago; ties go to the oldest block.

In exact decoding all blocks of a layer are read every step, so LRU reduces to FIFO by creation over the
layers read longest ago — the oldest blocks stream from lower tiers and the newest stay resident, spread
evenly over the layers. That is stable (nothing ping-pongs), which is what matters in exact mode; recency
starts to pay off when access is skewed (sparse attention, prefix reuse).

The index: per (tier, slot size, layer) an insertion-ordered dict of blocks, least recently used first
(a block read on its own moves to the end). A whole-layer read is O(1): it sets the layer's tick, which
every block of the layer then shares. ``victims`` merges the layers' heads with a heap keyed on
(effective tick, block id), so it costs O(n log layers), not a scan.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Iterator

from tierkv.blocks import Block, Tier
from tierkv.policy.base import Policy, register_policy


@register_policy
class LRUPolicy(Policy):
    name = "lru"

    def __init__(self) -> None:
        self._index: dict[tuple[Tier, int], dict[int, dict[int, Block]]] = {}  # (tier, slot) -> layer -> id -> block
        self._layer_tick: dict[int, int] = {}
        self._pinned: set[int] = set()

    def _layer_dict(self, block: Block) -> dict[int, Block]:
        return self._index.setdefault((block.tier, block.slot_bytes), {}).setdefault(block.layer, {})

    def on_insert(self, block: Block, tick: int) -> None:
        block.last_access = tick
        self._layer_dict(block)[block.id] = block

    def on_access(self, layer: int, tick: int, block_ids: Iterable[int] | None = None) -> None:
        if block_ids is None:
            self._layer_tick[layer] = tick
            return
        for layers in self._index.values():
            held = layers.get(layer)
            if held is None:
                continue
            for block_id in block_ids:
                block = held.pop(block_id, None)
                if block is not None:
                    block.last_access = tick
                    held[block_id] = block

    def on_release(self, block: Block) -> None:
        self._pinned.discard(block.id)
        self._layer_dict(block).pop(block.id, None)

    def on_move(self, block: Block, old_tier: Tier) -> None:
        layers = self._index.get((old_tier, block.slot_bytes), {})
        layers.get(block.layer, {}).pop(block.id, None)
        if block.id not in self._pinned:
            self._layer_dict(block)[block.id] = block

    def pin(self, block: Block) -> None:
        self._pinned.add(block.id)
        self._layer_dict(block).pop(block.id, None)

    def unpin(self, block: Block) -> None:
        if block.id in self._pinned:
            self._pinned.discard(block.id)
            self._layer_dict(block)[block.id] = block

    def victims(self, tier: Tier, slot_bytes: int, n: int, exclude: Collection[int] = ()) -> list[Block]:
        layers = self._index.get((tier, slot_bytes), {})
        heads: list[tuple[int, int, int, Iterator[Block], Block]] = []
        for layer, held in layers.items():
            it = (block for block in held.values() if block.id not in exclude)
            self._push(heads, layer, it)
        chosen: list[Block] = []
        while heads and len(chosen) < n:
            _, _, layer, it, block = heapq.heappop(heads)
            chosen.append(block)
            self._push(heads, layer, it)
        return chosen

    def _push(self, heads: list, layer: int, it: Iterator[Block]) -> None:
        block = next(it, None)
        if block is not None:
            tick = max(block.last_access, self._layer_tick.get(layer, 0))
            heapq.heappush(heads, (tick, block.id, layer, it, block))
