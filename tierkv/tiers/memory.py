"""Memory tiers (device and host): slabs of fixed-size slots under a byte budget.

A tier owns one :class:`SlabPool` per slot size (models whose layers differ in geometry get one pool per
geometry). A pool grows in chunks — one tensor of many slots each — so nothing is allocated per block
during decode, and a chunk is only returned when staging needs the room (see :meth:`MemoryTier.reserve`).
Every byte the tier holds, slots and staging alike, counts against its budget.
"""

from __future__ import annotations

import torch

from tierkv.blocks import Tier
from tierkv.tiers.slots import SlotPool, growth_slots

DEFAULT_CHUNK_BYTES = 64 * 2**20


class SlabPool(SlotPool):
    """Slots of ``slot_bytes`` bytes in chunk tensors ``[slots_per_chunk, slot_bytes]`` (uint8)."""

    def __init__(self, slot_bytes: int, device: torch.device, pin: bool) -> None:
        super().__init__()
        self.slot_bytes = slot_bytes
        self.device = device
        self.pin = pin
        self.chunks: list[torch.Tensor] = []
        self._chunk_of_slot: list[tuple[int, int]] = []  # slot -> (chunk, row)

    @property
    def allocated_bytes(self) -> int:
        return self.capacity * self.slot_bytes

    def add_chunk(self, slots: int) -> None:
        chunk = torch.empty((slots, self.slot_bytes), dtype=torch.uint8, device=self.device, pin_memory=self.pin)
        self._chunk_of_slot.extend((len(self.chunks), row) for row in range(slots))
        self.chunks.append(chunk)
        self.slots.grow(slots)

    def last_chunk_slots(self) -> range:
        """Slot ids of the newest chunk (the one :meth:`drop_last_chunk` would return)."""
        size = self.chunks[-1].shape[0]
        return range(self.capacity - size, self.capacity)

    def last_chunk_is_empty(self) -> bool:
        return bool(self.chunks) and self.slots.all_free(self.last_chunk_slots())

    def drop_last_chunk(self) -> int:
        """Release the newest chunk, whose slots must all be free; return the bytes released."""
        size = self.chunks[-1].shape[0]
        self.slots.shrink(size)
        chunk = self.chunks.pop()
        del self._chunk_of_slot[-size:]
        return chunk.numel()

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes, ``[slot_bytes]`` uint8 (a view: writes land in the slab)."""
        chunk, row = self._chunk_of_slot[slot]
        return self.chunks[chunk][row]

    def contiguous(self, slot: int, other: int) -> bool:
        """Whether slot ``other`` directly follows ``slot`` in memory (next row of the same chunk)."""
        chunk, row = self._chunk_of_slot[slot]
        return other == slot + 1 and self._chunk_of_slot[other] == (chunk, row + 1)

    def rows(self, first: int, count: int) -> torch.Tensor:
        """Slots ``first .. first + count - 1`` (contiguous, one chunk) as ``[count, slot_bytes]``."""
        chunk, row = self._chunk_of_slot[first]
        return self.chunks[chunk][row : row + count]


class MemoryTier:
    """The device tier (GPU HBM, or CPU memory on a CPU-only host) or the host tier (pinned when CUDA exists).

    ``budget`` bounds ``allocated_bytes``: slab chunks plus reserved staging bytes.
    """

    def __init__(self, tier: Tier, budget: int, device: torch.device, pin: bool = False,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.tier = tier
        self.budget = budget
        self.device = device
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self.pools: dict[int, SlabPool] = {}
        self.reserved = 0
        self.peak_bytes = 0  # high-water mark of allocated_bytes, to prove the budget held

    @property
    def allocated_bytes(self) -> int:
        return sum(pool.allocated_bytes for pool in self.pools.values()) + self.reserved

    @property
    def used_bytes(self) -> int:
        return sum(pool.used * pool.slot_bytes for pool in self.pools.values())

    def pool(self, slot_bytes: int) -> SlabPool:
        if slot_bytes not in self.pools:
            self.pools[slot_bytes] = SlabPool(slot_bytes, self.device, self.pin)
        return self.pools[slot_bytes]

    def alloc(self, slot_bytes: int) -> int | None:
        """A free slot for a block of ``slot_bytes``, growing the pool by a chunk if the budget allows."""
        pool = self.pool(slot_bytes)
        slot = pool.alloc()
        if slot is not None:
            return slot
        step = min(self.chunk_bytes, self.budget // 16)  # fine enough for staging to reclaim chunks
        count = growth_slots(self.budget, self.allocated_bytes, slot_bytes, step)
        if count == 0:
            return None
        pool.add_chunk(count)
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return pool.alloc()

    def free(self, slot_bytes: int, slot: int) -> None:
        self.pools[slot_bytes].free(slot)

    def view(self, slot_bytes: int, slot: int) -> torch.Tensor:
        return self.pools[slot_bytes].view(slot)

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` of staging against the budget; False if it does not fit even after trimming.

        Empty chunks are released first to make room; chunks that hold blocks are the caller's to evacuate.
        """
        while self.allocated_bytes + nbytes > self.budget and self._drop_an_empty_chunk():
            pass
        if self.allocated_bytes + nbytes > self.budget:
            return False
        self.reserved += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return True

    def unreserve(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def _drop_an_empty_chunk(self) -> bool:
        for pool in self.pools.values():
            if pool.last_chunk_is_empty():
                pool.drop_last_chunk()
                return True
        return False

    def release_all(self) -> None:
        self.pools.clear()
        self.reserved = 0
