"""Slot bookkeeping shared by every tier pool: which slot ids exist, which are free, how much to grow."""

from __future__ import annotations

import heapq


class FreeSlots:
    """Slot ids ``0 .. capacity - 1`` of one pool and which of them are free.

    Free slots are handed out lowest first (a min-heap, with a set for membership): blocks pack into the
    oldest chunk or file extent, so the newest one is the first to empty when its room is wanted back.
    """

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._free: set[int] = set()
        self.capacity = 0
        self.used = 0

    def grow(self, count: int) -> range:
        """Add ``count`` new free slots; return their ids."""
        added = range(self.capacity, self.capacity + count)
        for slot in added:
            heapq.heappush(self._heap, slot)
        self._free.update(added)
        self.capacity += count
        return added

    def shrink(self, count: int) -> None:
        """Remove the ``count`` highest slot ids, which must all be free."""
        dropped = set(range(self.capacity - count, self.capacity))
        if not dropped <= self._free:
            raise RuntimeError("FreeSlots.shrink: the slots to drop still hold blocks; evacuate them first")
        self._free -= dropped
        self._heap = [slot for slot in self._heap if slot not in dropped]
        heapq.heapify(self._heap)
        self.capacity -= count

    def all_free(self, slots: range) -> bool:
        return all(slot in self._free for slot in slots)

    def alloc(self) -> int | None:
        if not self._heap:
            return None
        slot = heapq.heappop(self._heap)
        self._free.discard(slot)
        self.used += 1
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.capacity:
            raise RuntimeError(f"FreeSlots.free: slot {slot} is not in use")
        heapq.heappush(self._heap, slot)
        self._free.add(slot)
        self.used -= 1


class SlotPool:
    """Base of a pool whose slots are tracked by a :class:`FreeSlots` (memory slabs, disk files)."""

    slot_bytes: int

    def __init__(self) -> None:
        self.slots = FreeSlots()

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    @property
    def used(self) -> int:
        return self.slots.used

    def alloc(self) -> int | None:
        return self.slots.alloc()

    def free(self, slot: int) -> None:
        self.slots.free(slot)


def growth_slots(budget: int, allocated: int, slot_bytes: int, step_bytes: int) -> int:
    """Slots to add to a pool: a step's worth (at least one), never past the budget; 0 when it is full."""
    room = (budget - allocated) // slot_bytes
    return int(min(room, max(1, step_bytes // slot_bytes))) if room > 0 else 0
