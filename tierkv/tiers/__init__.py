"""Tier pools: fixed-slot slab allocators, one object per tier (device, host, disk)."""

from tierkv.tiers.memory import MemoryTier, SlabPool

__all__ = ["MemoryTier", "SlabPool"]
