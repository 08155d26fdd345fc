"""Least recently used: demote the block read longest ago; ties go to the oldest block.

In exact decoding all blocks are read every step, so LRU reduces to FIFO by creation — the oldest
blocks stream from lower tiers and the newest stay resident. That is stable (nothing ping-pongs), which
is what matters in exact mode; recency starts to pay off when access is skewed (sparse attention,
prefix reuse).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from tierkv.blocks import Block
from tierkv.policy.base import Policy, register_policy


@register_policy
class LRUPolicy(Policy):
    name = "lru"

    def victims(self, candidates: Iterable[Block], n: int) -> list[Block]:
        return heapq.nsmallest(n, candidates, key=lambda block: (block.last_access, block.id))
