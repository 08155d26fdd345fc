"""Slot bookkeeping shared by every tier pool: which slot ids exist, which are free, how much to grow."""

from __future__ import annotations

import heapq
from collections.abc import Collection

from tierkv.atomic import deferred_interrupts

GROUP_RUN = 16  # blocks of a layer that share a run of slots (4 MiB at 256 KiB blocks: one large request)


class FreeSlots:
    """Slot ids ``0 .. capacity - 1`` of one pool and which of them are free.

    Free slots are handed out lowest first (a min-heap, with a set for membership): blocks pack into the
    oldest chunk or file extent, so the newest one is the first to empty when its room is wanted back.

    An allocation may say where its block sits in its sequence, ``near=(layer, index)``: blocks
    ``16k .. 16k + 15`` of a layer then share a run of :data:`GROUP_RUN` consecutive slots, block ``i`` at
    offset ``i % 16``, so however the layer's blocks arrive (interleaved with other layers', demoted out of
    order) they sit in sequence order and a read of them coalesces into one large request. A run's other
    slots are reserved, still free; when nothing unreserved is left and the pool cannot grow, the owner
    calls :meth:`reclaim` and every reservation is released. The
    heap is lazy (entries of slots taken out of order are skipped when they surface): O(1) amortised.
    """

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._free: set[int] = set()
        self._owner: dict[int, tuple[int, int]] = {}  # reserved free slot -> its run's group
        self._runs: dict[tuple[int, int], list[int]] = {}  # group -> [first slot, reserved slots left]
        self.capacity = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)  # derived, so no interrupt can set it apart from the free set

    def in_use(self) -> set[int]:
        """Slot ids not free (O(capacity): for recovery after an interrupt, not the hot path)."""
        return set(range(self.capacity)) - self._free

    def grow(self, count: int) -> range:
        """Add ``count`` new free slots; return their ids."""
        added = range(self.capacity, self.capacity + count)
        with deferred_interrupts():  # rare (a pool grows by a chunk): the three change together
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
        self._release_reservations()
        heap = [slot for slot in self._heap if slot not in dropped]
        heapq.heapify(heap)
        with deferred_interrupts():
            self._free -= dropped
            self.capacity -= count
            self._heap = heap

    def all_free(self, slots: range) -> bool:
        return all(slot in self._free for slot in slots)

    def alloc(self, near: tuple[int, int] | None = None) -> int | None:
        """A free slot; with ``near=(layer, index)``, the one for block ``index`` in its layer's run."""
        slot = self._in_run(near) if near is not None else None
        if slot is None:
            base = self._lowest()
            if base is None:
                return None  # the pool grows, or reclaim() gives the reserved slots back
            slot = base
            if near is not None and self._open_run(base, near):
                slot = self._in_run(near)
                if slot is None:  # the block's own place in the new run is taken: it gets the run's first slot
                    slot = base
                    self._unreserve(base)
        self._free.discard(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.capacity:
            raise RuntimeError(f"FreeSlots.free: slot {slot} is not in use")
        heapq.heappush(self._heap, slot)
        self._free.add(slot)

    def _in_run(self, near: tuple[int, int]) -> int | None:
        """The reserved slot of block ``near`` in its group's run, taken out of the reservation; None if none."""
        layer, index = near
        run = self._runs.get((layer, index // GROUP_RUN))
        slot = run[0] + index % GROUP_RUN if run is not None else -1
        if self._owner.get(slot) != (layer, index // GROUP_RUN):
            return None
        self._unreserve(slot)
        return slot

    def _unreserve(self, slot: int) -> None:
        group = self._owner.pop(slot)
        run = self._runs[group]
        run[1] -= 1
        if run[1] == 0:
            del self._runs[group]

    def _open_run(self, base: int, near: tuple[int, int]) -> bool:
        """Reserve the run of ``near``'s group from ``base`` (the lowest free slot): its free slots
        ``base .. base + 15``, block ``16k + i`` at ``base + i``. False if the group already has a run (the
        block's own slot there was taken: it goes elsewhere, the run stays)."""
        layer, index = near
        group = (layer, index // GROUP_RUN)
        if group in self._runs:
            return False
        run = self._runs[group] = [base, 0]
        for slot in range(base, min(base + GROUP_RUN, self.capacity)):  # a run ends where the pool does
            if slot in self._free and slot not in self._owner:
                self._owner[slot] = group
                run[1] += 1
        return True

    def _lowest(self) -> int | None:
        """The lowest free slot no run holds (reserved ones are skipped: their runs take them)."""
        while self._heap:
            slot = heapq.heappop(self._heap)
            if slot in self._free and slot not in self._owner:
                return slot
        return None

    def reclaim(self) -> bool:
        """Release every run's reserved slots (the pool cannot grow and nothing else is free); False if
        there were none."""
        if not self._owner:
            return False
        self._release_reservations()
        return True

    def _release_reservations(self) -> None:
        for slot in self._owner:
            heapq.heappush(self._heap, slot)
        self._owner.clear()
        self._runs.clear()


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

    def alloc(self, near: tuple[int, int] | None = None) -> int | None:
        return self.slots.alloc(near)

    def reclaim(self) -> bool:
        return self.slots.reclaim()

    def free(self, slot: int) -> None:
        self.slots.free(slot)

    def free_all(self) -> None:
        """Every slot free again (a reset: also what an interrupted operation may have left taken)."""
        slots = FreeSlots()
        slots.grow(self.slots.capacity)
        self.slots = slots

    def release_unheld(self, held: Collection[int]) -> int:
        """Free every slot in use that is not in ``held`` — what an interrupted operation took and never
        recorded; return how many."""
        orphans = sorted(self.slots.in_use().difference(held))
        for slot in orphans:
            self.free(slot)
        return len(orphans)


def growth_slots(budget: int, allocated: int, slot_bytes: int, step_bytes: int) -> int:
    """Slots to add to a pool: a step's worth (at least one), never past the budget; 0 when it is full."""
    room = (budget - allocated) // slot_bytes
    return int(min(room, max(1, step_bytes // slot_bytes))) if room > 0 else 0
