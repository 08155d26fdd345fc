"""Small builders shared by the store tests."""

from __future__ import annotations

import torch

from tierkv.blocks import Tier
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier

SLOT = 4096  # every test layout below fits one 4 KiB slot per block


def make_store(tmp_path, device_slots: int, host_slots: int, disk_bytes: int | None = 2**22,
               block_tokens: int = 4, staging_bytes: int = 0, extent_slots: int = 4) -> KVStore:
    """A store whose tiers hold the given number of 4 KiB slots (staging bytes come on top); small slab
    chunks and disk extents, so growth, evacuation and run reservations are exercised."""
    device = MemoryTier(Tier.DEVICE, device_slots * SLOT + staging_bytes, torch.device("cpu"), chunk_bytes=2 * SLOT)
    host = MemoryTier(Tier.HOST, host_slots * SLOT, torch.device("cpu"), chunk_bytes=2 * SLOT)
    disk = DiskTier(tmp_path / "disk", disk_bytes, extent_bytes=extent_slots * SLOT) if disk_bytes is not None else None
    return KVStore(device, host, disk, make_policy("lru"), block_tokens)


def kv(batch: int, tokens: int, heads: int = 2, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, dim, generator=generator)
    return keys, torch.randn(batch, heads, tokens, dim, generator=generator)
