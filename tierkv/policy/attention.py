"""Attention-aware placement: a block keeps its tier by the attention it receives, decayed over decode steps.

A block's *score* is the softmax mass sparse attention gave it (its share of each step's attention, averaged
over heads — :func:`tierkv.attention.sparse`'s reads, never a materialised attention matrix), halved every
:data:`HALF_LIFE` ticks (decode steps)::

    score(t) = Σ_i mass_i · 2^(-(t - t_i) / HALF_LIFE)  =  2^(-t / HALF_LIFE) · S
           S = Σ_i mass_i · 2^(t_i / HALF_LIFE)

Every block decays by the same factor, so ordering by ``S`` (kept as ``log2 S``) never changes with time.

A layer-step's mass arrives as arrays (one entry per block read, per row) and is added in one vectorized
operation into ``log2 S`` kept per block id (ids are never reused): no Python runs per attended block. The
victim index is a sorted list per (tier, slot size) of ``(key, id)``, where the key is the block's ``log2 S``
when it was last placed there. ``S`` only grows, so a key can only be too low: :meth:`victims` walks the list
from the coldest end and re-places an entry whose block received mass since (a lazy increase-key) before it
answers — each block at most once per call, and hot blocks, which are the ones that receive mass, are rarely
reached from the cold end.

Victims: blocks that never received mass first, least recently used first (an inner :class:`LRUPolicy`: in exact
mode, where no mass is recorded, this policy *is* LRU), then the others by ascending score. Promotion (sparse
mode only, through the store): an off-device block whose score reached :data:`PROMOTE_SCORE` moves up when the
device has a free slot, or takes the slot of the device's coldest block if it scores :data:`PREFER_MARGIN` times
more (the margin keeps two blocks from swapping places every step). Nothing is dropped: the block it replaces
moves down a tier.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import numpy as np
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
        self._log_s = np.full(64, -np.inf)  # block id -> log2 S (-inf: no mass yet)
        self._live = np.zeros(64, dtype=bool)  # block id -> inserted and not released
        self._keys: dict[int, float] = {}  # block id -> its key in the sorted index (massed, unpinned blocks)
        self._sorted: dict[tuple[Tier, int], SortedList] = {}  # (tier, slot) -> (key, id) of massed blocks
        self._blocks: dict[int, Block] = {}
        self._pinned: set[int] = set()
        self._now = 0

    # ------------------------------------------------------------------------------------ events
    def on_insert(self, block: Block, tick: int) -> None:
        self._blocks[block.id] = block
        self._room(block.id + 1)
        self._live[block.id] = True
        self._log_s[block.id] = -np.inf
        self._lru.on_insert(block, tick)

    def on_access(self, layer: int, tick: int, block_ids: Iterable[int] | None = None) -> None:
        self._now = max(self._now, tick)
        self._lru.on_access(layer, tick, block_ids)

    def on_attention(self, layer: int, tick: int, block_ids: np.ndarray, mass: np.ndarray) -> None:
        self._now = max(self._now, tick)
        ids = np.asarray(block_ids, dtype=np.int64)
        weights = np.asarray(mass, dtype=np.float64)
        if ids.size == 0:
            return
        self._room(int(ids.max()) + 1)
        live = self._live[ids]
        positive = live & (weights > 0.0)
        fresh = np.unique(ids[positive & np.isneginf(self._log_s[ids])])  # their first mass
        np.logaddexp2.at(self._log_s, ids[positive], np.log2(weights[positive]) + tick / HALF_LIFE)
        for block_id in fresh.tolist():  # once in a block's life: it leaves the never-attended set
            block = self._blocks[block_id]
            self._lru.on_release(block)
            if block_id not in self._pinned:
                self._place(block)
        massless = ids[live & ~(weights > 0.0) & np.isneginf(self._log_s[ids])]
        if massless.size:
            self._lru.on_access(layer, tick, massless)

    def on_release(self, block: Block) -> None:
        self._blocks.pop(block.id, None)
        if self._massed(block.id):
            self._unplace(block, block.tier)
        else:
            self._lru.on_release(block)
        if block.id < self._live.size:
            self._live[block.id] = False
            self._log_s[block.id] = -np.inf
        self._pinned.discard(block.id)

    def on_move(self, block: Block, old_tier: Tier) -> None:
        if not self._massed(block.id):
            self._lru.on_move(block, old_tier)
        elif block.id not in self._pinned:
            self._unplace(block, old_tier)
            self._place(block)

    def pin(self, block: Block) -> None:
        if block.id in self._pinned:
            return
        if self._massed(block.id):
            self._unplace(block, block.tier)
        else:
            self._lru.pin(block)
        self._pinned.add(block.id)

    def unpin(self, block: Block) -> None:
        if block.id not in self._pinned:
            return
        self._pinned.discard(block.id)
        if self._massed(block.id):
            self._place(block)
        else:
            self._lru.unpin(block)

    # ----------------------------------------------------------------------------------- answers
    def victims(self, tier: Tier, slot_bytes: int, n: int, exclude: Collection[int] = ()) -> list[Block]:
        chosen = self._lru.victims(tier, slot_bytes, n, exclude)
        index = self._sorted.get((tier, slot_bytes))
        at = 0
        while index is not None and len(chosen) < n and at < len(index):
            key, block_id = index[at]
            current = float(self._log_s[block_id])
            if current != key:  # it received mass since it was placed: place it by its score now, look again
                index.remove((key, block_id))
                index.add((current, block_id))
                self._keys[block_id] = current
                continue
            if block_id not in exclude:
                chosen.append(self._blocks[block_id])
            at += 1
        return chosen

    def score(self, block: Block) -> float:
        """The block's decayed attention mass now (0 if it never received any)."""
        if block.id >= self._log_s.size:
            return 0.0
        return float(2.0 ** (self._log_s[block.id] - self._now / HALF_LIFE))

    def promotions(self, block_ids: np.ndarray, limit: int) -> list[int]:
        ids = np.unique(np.asarray(block_ids, dtype=np.int64))
        ids = ids[ids < self._log_s.size]
        log_s = self._log_s[ids]
        hot = log_s - self._now / HALF_LIFE >= math.log2(PROMOTE_SCORE)
        ranked = ids[hot][np.argsort(-log_s[hot], kind="stable")]  # hottest first
        chosen: list[int] = []
        for block_id in ranked.tolist():  # stops after ``limit`` (pinned blocks are skipped)
            if len(chosen) == limit:
                break
            if block_id not in self._pinned:
                chosen.append(block_id)
        return chosen

    def prefers(self, block: Block, resident: Block) -> bool:
        return self.score(block) > PREFER_MARGIN * self.score(resident)

    # ----------------------------------------------------------------------------------- index
    def _massed(self, block_id: int) -> bool:
        return block_id < self._log_s.size and not np.isneginf(self._log_s[block_id])

    def _place(self, block: Block) -> None:
        key = float(self._log_s[block.id])
        self._sorted.setdefault((block.tier, block.slot_bytes), SortedList()).add((key, block.id))
        self._keys[block.id] = key

    def _unplace(self, block: Block, tier: Tier) -> None:
        key = self._keys.pop(block.id, None)
        if key is not None:
            self._sorted.get((tier, block.slot_bytes), SortedList()).discard((key, block.id))

    def _room(self, size: int) -> None:
        """Grow the per-id arrays (geometrically) to hold ids below ``size``."""
        if size <= self._log_s.size:
            return
        grown = max(size, 2 * self._log_s.size)
        self._log_s = np.concatenate((self._log_s, np.full(grown - self._log_s.size, -np.inf)))
        self._live = np.concatenate((self._live, np.zeros(grown - self._live.size, dtype=bool)))
