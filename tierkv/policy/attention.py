"""Attention-aware placement: a block keeps its tier by the attention it receives, decayed over decode steps.

A block's *score* is the softmax mass sparse attention gave it (its share of each step's attention, averaged
over heads — :func:`tierkv.attention.sparse`'s reads, never a materialised attention matrix), halved every
:data:`HALF_LIFE` ticks (decode steps)::

    score(t) = Σ_i mass_i · 2^(-(t - t_i) / HALF_LIFE)  =  2^(-t / HALF_LIFE) · S
           S = Σ_i mass_i · 2^(t_i / HALF_LIFE)

Every block decays by the same factor, so ordering by ``S`` (kept as ``log2 S``) never changes with time: the
index is a sorted list per (tier, slot size) that only moves the blocks that just received mass, O(log n) each.

Victims: blocks that never received mass first, least recently used first (an inner :class:`LRUPolicy`: in exact
mode, where no mass is recorded, this policy *is* LRU), then the others by ascending score. Promotion (sparse
mode only, through the store): an off-device block whose score reached :data:`PROMOTE_SCORE` moves up when the
device has a free slot, or takes the slot of the device's coldest block if it scores :data:`PREFER_MARGIN` times
more (the margin keeps two blocks from swapping places every step). Nothing is dropped: the block it replaces
moves down a tier.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence

from sortedcontainers import SortedList

from tierkv.blocks import Block, Tier
from tierkv.policy.base import Policy, register_policy
from tierkv.policy.lru import LRUPolicy

HALF_LIFE = 32.0  # ticks (decode steps) for a block's attention mass to halve
PROMOTE_SCORE = 0.25  # decayed mass at which an off-device block is worth a device slot
PREFER_MARGIN = 2.0  # a block replaces a device block only if it scores this many times more


@register_policy
class AttentionPolicy(Policy):
    name = "attention"
    wants_mass = True  # sparse attention measures each read block's softmax mass for this policy

    def __init__(self) -> None:
        self._lru = LRUPolicy()  # blocks that never received mass
        self._log_s: dict[int, float] = {}  # block id -> log2 S (blocks that received mass)
        self._sorted: dict[tuple[Tier, int], SortedList] = {}  # (tier, slot) -> (log2 S, id) of massed blocks
        self._blocks: dict[int, Block] = {}
        self._pinned: set[int] = set()
        self._now = 0

    # ------------------------------------------------------------------------------------ events
    def on_insert(self, block: Block, tick: int) -> None:
        self._blocks[block.id] = block
        self._lru.on_insert(block, tick)

    def on_access(self, layer: int, tick: int, block_ids: Iterable[int] | None = None) -> None:
        self._now = max(self._now, tick)
        self._lru.on_access(layer, tick, block_ids)

    def on_attention(self, layer: int, tick: int, block_ids: Sequence[int], mass: Sequence[float]) -> None:
        self._now = max(self._now, tick)
        grown = tick / HALF_LIFE
        massless = []
        for block_id, weight in zip(block_ids, mass):
            block = self._blocks.get(block_id)
            if block is None:
                continue
            if weight <= 0.0:
                massless.append(block_id)
                continue
            old = self._log_s.get(block_id)
            new = math.log2(weight) + grown
            if old is None:
                self._lru.on_release(block)  # it leaves the never-attended set (pinned or not)
            else:
                new = _log2_add(old, new)
                if block_id not in self._pinned:
                    self._index(block).remove((old, block_id))
            self._log_s[block_id] = new
            if block_id not in self._pinned:
                self._index(block).add((new, block_id))
        if massless:
            self._lru.on_access(layer, tick, massless)

    def on_release(self, block: Block) -> None:
        self._blocks.pop(block.id, None)
        log_s = self._log_s.pop(block.id, None)
        if log_s is None:
            self._lru.on_release(block)
        elif block.id not in self._pinned:
            self._index(block).discard((log_s, block.id))
        self._pinned.discard(block.id)

    def on_move(self, block: Block, old_tier: Tier) -> None:
        log_s = self._log_s.get(block.id)
        if log_s is None:
            self._lru.on_move(block, old_tier)
        elif block.id not in self._pinned:
            self._sorted.get((old_tier, block.slot_bytes), SortedList()).discard((log_s, block.id))
            self._index(block).add((log_s, block.id))

    def pin(self, block: Block) -> None:
        if block.id in self._pinned:
            return
        log_s = self._log_s.get(block.id)
        if log_s is None:
            self._lru.pin(block)
        else:
            self._index(block).discard((log_s, block.id))
        self._pinned.add(block.id)

    def unpin(self, block: Block) -> None:
        if block.id not in self._pinned:
            return
        self._pinned.discard(block.id)
        log_s = self._log_s.get(block.id)
        if log_s is None:
            self._lru.unpin(block)
        else:
            self._index(block).add((log_s, block.id))

    # ----------------------------------------------------------------------------------- answers
    def victims(self, tier: Tier, slot_bytes: int, n: int, exclude: Collection[int] = ()) -> list[Block]:
        chosen = self._lru.victims(tier, slot_bytes, n, exclude)
        if len(chosen) < n:
            for _, block_id in self._sorted.get((tier, slot_bytes), ()):
                if block_id not in exclude:
                    chosen.append(self._blocks[block_id])
                    if len(chosen) == n:
                        break
        return chosen

    def score(self, block: Block) -> float:
        """The block's decayed attention mass now (0 if it never received any)."""
        log_s = self._log_s.get(block.id)
        return 0.0 if log_s is None else 2.0 ** (log_s - self._now / HALF_LIFE)

    def promotions(self, blocks: Sequence[Block], limit: int) -> list[Block]:
        hot = [b for b in blocks if b.id not in self._pinned and self.score(b) >= PROMOTE_SCORE]
        return sorted(hot, key=self.score, reverse=True)[:limit]

    def prefers(self, block: Block, resident: Block) -> bool:
        return self.score(block) > PREFER_MARGIN * self.score(resident)

    def _index(self, block: Block) -> SortedList:
        return self._sorted.setdefault((block.tier, block.slot_bytes), SortedList())


def _log2_add(a: float, b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    high, low = (a, b) if a >= b else (b, a)
    return high + math.log2(1.0 + 2.0 ** (low - high))
