"""Memory tiers (device and host): slabs of fixed-size slots under a byte budget.

A tier owns one :class:`SlabPool` per slot size (models whose layers differ in geometry get one pool per
geometry). A pool grows in chunks — one tensor of many slots each — so nothing is allocated per block
during decode, and a chunk is only returned when staging needs the room (see :meth:`MemoryTier.reserve`).
Every byte the tier holds, slots and staging alike, counts against its budget.

Memory is taken by need, not by budget: a pool's first chunk is at most :data:`FIRST_CHUNK_BYTES`, and each
next one as large as the pool already is (it doubles), up to 1/16 of the budget. A small KV on a large budget
then holds about twice its bytes, and a pool has few chunks (at most 16 of the largest size, plus the
doubling ones): a read of any number of blocks is one ``index_select`` per chunk the blocks live in, straight
into the (strided) destination.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import torch

from tierkv.accel import DEVICE, HOST, HostOnly, backend, host_backend
from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Tier
from tierkv.errors import memory_for
from tierkv.layout import BlockLayout, SlotBytes
from tierkv.staging import CHUNKS_PER_BUDGET  # chunks are at most 1/16 of the budget: staging can take them back
from tierkv.tiers.base import Dest, Scratch, landing_pieces
from tierkv.tiers.slots import SlotPool, growth_slots
from tierkv.units import format_bytes

BOUND_DESTINATIONS = 4  # destination lists a read's memo keeps compiled copies for
FIRST_CHUNK_BYTES = 1 << 20  # a pool's first chunk; each next one doubles the pool, up to the tier's chunk_bytes
PINNED_CHUNK_BYTES = 1 << 30  # page-locking is slow and bounded by the OS: pinned slabs grow by at most this


class SlabPool(SlotPool):
    """Slots of ``slot_bytes`` bytes in chunk tensors ``[slots_per_chunk, slot_bytes]`` (uint8), in the device's
    memory (``space`` "device", a device tier on an accelerator) or the host's, allocated through ``accel``."""

    def __init__(self, slot_bytes: int, device: torch.device, pin: bool, accel: HostOnly, space: str) -> None:
        super().__init__()
        self.slot_bytes = slot_bytes
        self.device = device
        self.pin = pin
        self.accel = accel
        self.space = space
        self.chunks: list[torch.Tensor] = []
        self._starts = np.zeros(0, dtype=np.int64)  # first slot id of each chunk
        self._start_list: list[int] = []  # the same, for bisect on single slots (cheaper than numpy calls)
        self._typed: dict[tuple[int, object], torch.Tensor] = {}  # (chunk, layout) -> typed block view

    @property
    def allocated_bytes(self) -> int:
        return self.capacity * self.slot_bytes

    def add_chunk(self, slots: int) -> None:
        """Grow by a chunk of ``slots`` slots; CapacityError where the memory is not there although the budget
        allows it (the budget is a cap, the machine's memory the fact)."""
        budget = "gpu_gb" if self.space == DEVICE else "cpu_gb"
        tier = "device" if self.space == DEVICE else "host"
        with memory_for(f"the {tier} tier could not allocate {format_bytes(slots * self.slot_bytes)} more on "
                        f"{self.device} although {budget} allows it", f"give a smaller {budget}"):
            if self.space == DEVICE:
                chunk = self.accel.empty(slots * self.slot_bytes, self.device).view(slots, self.slot_bytes)
            else:
                chunk = self.accel.host_empty((slots, self.slot_bytes), self.pin)
        starts = np.append(self._starts, self.capacity)
        with deferred_interrupts():  # chunks, their starts and the slot ids change together
            self._starts = starts
            self._start_list.append(self.capacity)
            self.chunks.append(chunk)
            self._typed.clear()
            self.slots.grow(slots)

    def last_chunk_slots(self) -> range:
        """Slot ids of the newest chunk (the one :meth:`drop_last_chunk` would return)."""
        return range(int(self._starts[-1]), self.capacity)

    def last_chunk_is_empty(self) -> bool:
        return bool(self.chunks) and self.slots.all_free(self.last_chunk_slots())

    def drop_last_chunk(self) -> int:
        """Release the newest chunk, whose slots must all be free; return the bytes released."""
        size = self.chunks[-1].shape[0]
        with deferred_interrupts():
            self.slots.shrink(size)
            self._starts = self._starts[:-1]
            self._start_list.pop()
            self._typed.clear()
            return self.chunks.pop().numel()

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes, ``[slot_bytes]`` uint8 (a view: writes land in the slab)."""
        chunk = bisect.bisect_right(self._start_list, slot) - 1
        return self.chunks[chunk][slot - self._start_list[chunk]]

    def typed(self, chunk: int, layout: BlockLayout | SlotBytes) -> torch.Tensor:
        """Chunk ``chunk`` as blocks of ``layout`` (a cached view)."""
        view = self._typed.get((chunk, layout))
        if view is None:
            view = self._typed[(chunk, layout)] = layout.blocks_of(self.chunks[chunk])
        return view

    def block(self, layout: BlockLayout, slot: int) -> torch.Tensor:
        """One slot as a block ``[2, H_kv, block_tokens, D]`` (a view into the slab)."""
        chunk = bisect.bisect_right(self._start_list, slot) - 1
        return self.typed(chunk, layout)[slot - self._start_list[chunk]]

    def locate(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(chunk, row within the chunk) of each slot, vectorised."""
        chunk = np.searchsorted(self._starts, slots, side="right") - 1
        return chunk, slots - self._starts[chunk]

    def gather(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, dests: Sequence[Dest],
               landing: torch.Tensor | None = None, memo: dict | None = None) -> None:
        """Copy the blocks in ``slots`` into ``dests``: one ``index_select`` per run of slots in one chunk;
        through ``landing`` (a device buffer) when the destination is on another device than the slab.
        ``memo`` (a dict that lives as long as ``slots`` does, e.g. a cached plan's) keeps the index tensors."""
        accel = self.accel
        select = accel.index_select if self.space == DEVICE else _index_select  # a stream op, or the CPU's
        bound = memo.get("bound") if memo is not None else None
        known = bound.get(id(dests)) if bound is not None else None
        if known is not None and known[0] is dests:  # a destination list seen before (a cached plan's), bound below:
            for source, index, out in known[1]:  # in this pool's memory, so no landing buffer is used for it
                select(source, index, out)
            return
        target = accel.space(dests[0][2]) if dests else self.space  # the destinations are views of one tensor
        if landing is not None and target != DEVICE:
            landing = None  # the landing buffer lives on the device tier: of no use for a read into host memory
        if landing is not None or target != self.space:
            chunks, rows = self.locate(slots)
            for lo, hi, out in dests:
                self._gather_across(layout, chunks, rows, lo, hi, out, landing)
            return
        program = memo.get("gather") if memo is not None else None
        if program is None:
            program = self._program(slots, [(lo, hi) for lo, hi, _ in dests])
            if memo is not None:
                memo["gather"] = program
        calls = [(self.typed(chunk, layout), index, out[a:b])
                 for (_, _, out), steps in zip(dests, program) for a, b, chunk, index in steps]
        if memo is not None:
            if bound is None or len(bound) >= BOUND_DESTINATIONS:
                bound = memo["bound"] = {}
            bound[id(dests)] = (dests, calls)  # holds the list, so its id stays unique while it is cached
        for source, index, out in calls:
            select(source, index, out)

    def _program(self, slots: np.ndarray,
                 ranges: list[tuple[int, int]]) -> list[list[tuple[int, int, int, torch.Tensor]]]:
        """Per destination range: ``(a, b, chunk, rows)`` steps, offsets relative to the range."""
        chunks, rows = self.locate(slots)
        return [[(a - lo, b - lo, chunk, torch.from_numpy(rows[a:b]).to(self.device))
                 for a, b, chunk in _runs(chunks, lo, hi)] for lo, hi in ranges]

    def _gather_across(self, layout: BlockLayout | SlotBytes, chunks: np.ndarray, rows: np.ndarray, lo: int, hi: int,
                       out: torch.Tensor, landing: torch.Tensor | None) -> None:
        """Host slab -> device: runs of consecutive slots cross the link as one large copy each, straight into
        ``out`` when it is contiguous; else into the landing buffer, in pieces of its capacity, which then land in
        ``out`` with one on-device copy (a strided destination would make every run's copy a slow one)."""
        copy = self.accel.copy
        if landing is None or out.is_contiguous():
            for a, b in _consecutive(chunks, rows, lo, hi):
                first = int(rows[a])
                copy(out[a - lo : b - lo], layout.blocks_of(self.chunks[chunks[a]][first : first + b - a]))
            return
        for piece, end, landed in landing_pieces(landing, self.slot_bytes, lo, hi):
            for a, b in _consecutive(chunks, rows, piece, end):
                first = int(rows[a])
                copy(landed[a - piece : b - piece], self.chunks[chunks[a]][first : first + b - a])
            copy(out[piece - lo : end - lo], layout.blocks_of(landed))

    def scatter(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, src: torch.Tensor) -> None:
        """Write blocks ``src`` ``[n, 2, H_kv, block_tokens, D]`` into ``slots``: one ``index_copy_`` per chunk run."""
        chunks, rows = self.locate(slots)
        accel = self.accel
        if self.space == HOST and accel.space(src) != HOST:
            # device data: one DMA per run of consecutive slots straight into the (pinned) slab, blocking, so the
            # CPU never reads a slot the GPU has not finished writing
            for a, b in _consecutive(chunks, rows, 0, len(slots)):
                first = int(rows[a])
                accel.copy_to_host(self.typed(int(chunks[a]), layout)[first : first + b - a], src[a:b])
            return
        for a, b, chunk in _runs(chunks, 0, len(slots)):
            index = torch.from_numpy(rows[a:b]).to(self.device)
            typed = self.typed(chunk, layout)
            if self.space == DEVICE:
                accel.index_copy(typed, index, src[a:b])
            else:  # the CPU writes slots the GPU may have read: the barrier before their reuse ordered that
                accel.host_write(typed, index)
                typed.index_copy_(0, index, src[a:b].to(self.device))


class MemoryTier:
    """The device tier (GPU HBM, or CPU memory on a CPU-only host) or the host tier (pinned when CUDA exists).

    ``budget`` bounds ``allocated_bytes``: slab chunks plus reserved staging bytes. ``chunk_bytes`` is the
    largest chunk a pool grows by (default 1/16 of the budget); pools start smaller and double (see the module).

    Staging (executors' buffers, sparse attention's summaries) is counted with :meth:`reserve` /
    :meth:`unreserve`. When a reservation does not fit, the store empties a chunk: :meth:`evacuation` names it,
    :meth:`alloc_outside` and :meth:`copy_slot` relocate what must stay on this tier, :meth:`drop_chunk` gives
    it back. The store never reaches into the pools.
    """

    def __init__(self, tier: Tier, budget: int, device: torch.device, pin: bool = False,
                 chunk_bytes: int | None = None) -> None:
        self.kind = tier
        self.budget = budget
        self.device = device
        self.pin = pin
        self.accel = backend(device) if tier == Tier.DEVICE else host_backend()
        self.space = DEVICE if tier == Tier.DEVICE and self.accel.streams else HOST
        self._write_fence: Any = None  # see fence_writes
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else max(1, budget // CHUNKS_PER_BUDGET)
        if pin:
            self.chunk_bytes = min(self.chunk_bytes, PINNED_CHUNK_BYTES)
        self.pools: dict[int, SlabPool] = {}
        self.reserved = 0
        self.peak_bytes = 0  # high-water mark of allocated_bytes, to prove the budget held

    @property
    def allocated_bytes(self) -> int:
        return sum(pool.allocated_bytes for pool in self.pools.values()) + self.reserved

    @property
    def unallocated_bytes(self) -> int:
        """What the budget still lets this tier allocate (slab chunks or staging)."""
        return self.budget - self.allocated_bytes

    @property
    def used_bytes(self) -> int:
        return sum(pool.used * pool.slot_bytes for pool in self.pools.values())

    def pool(self, slot_bytes: int) -> SlabPool:
        if slot_bytes not in self.pools:
            self.pools[slot_bytes] = SlabPool(slot_bytes, self.device, self.pin, self.accel, self.space)
        return self.pools[slot_bytes]

    def alloc(self, slot_bytes: int, near: tuple[int, int] | None = None) -> int | None:
        """A free slot for a block of ``slot_bytes`` (beside its sequence neighbours where it can), growing
        the pool by a chunk if the budget allows."""
        if self.kind == Tier.DEVICE:
            near = None  # device blocks gather in place: neighbours buy nothing, and reserved room would
            # make the pool grow into space that staging may need
        pool = self.pool(slot_bytes)
        slot = pool.alloc(near)
        if slot is not None:
            return slot
        count = growth_slots(self.budget, self.allocated_bytes, slot_bytes, self._step_bytes(pool))
        if count:
            pool.add_chunk(count)
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            slot = pool.alloc(near)
        if slot is None and pool.reclaim():  # only runs' reserved slots are left: give them out
            slot = pool.alloc(near)
        return slot

    def _step_bytes(self, pool: SlabPool) -> int:
        """The next chunk of ``pool``: as large as the pool is (it doubles, following the KV), at least the first
        chunk's size, at most ``chunk_bytes``."""
        return min(self.chunk_bytes, max(FIRST_CHUNK_BYTES, pool.allocated_bytes))

    def free(self, slot_bytes: int, slot: int) -> None:
        self.pools[slot_bytes].free(slot)

    def room(self, slot_bytes: int) -> int:
        """Slots of ``slot_bytes`` still to be had: the pool's free ones plus those its budget lets it grow by."""
        pool = self.pools.get(slot_bytes)
        free = pool.capacity - pool.used if pool is not None else 0
        return free + max(0, self.unallocated_bytes // slot_bytes)

    def slot_sizes(self) -> list[int]:
        """The slot sizes this tier has pools for."""
        return list(self.pools)

    def block(self, layout: BlockLayout, slot: int) -> torch.Tensor:
        """One slot as a block ``[2, H_kv, block_tokens, D]`` (a view into the slab)."""
        return self.pools[layout.slot_bytes].block(layout, slot)

    def slabs(self, layout: BlockLayout) -> list[torch.Tensor]:
        """The chunks holding ``layout``'s blocks, each as blocks ``[slots, 2, H_kv, block_tokens, D]`` (cached
        views), in slot order: slot ids count on from one chunk to the next. For kernels that read blocks in
        place; valid until the pool grows or gives a chunk back."""
        pool = self.pools.get(layout.slot_bytes)
        return [pool.typed(i, layout) for i in range(len(pool.chunks))] if pool is not None else []

    def start_read(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, scratch: Scratch,
                   memo: dict | None = None, purpose: str = "read") -> _MemoryRead:
        # device blocks are gathered in place; the others through the finishing thread's landing buffer
        return _MemoryRead(self.pools[layout.slot_bytes], layout, slots, scratch if self.kind != Tier.DEVICE
                           else None, memo)

    def write_from(self, layout: BlockLayout | SlotBytes, slots: np.ndarray, src: torch.Tensor,
                   scratch: Scratch) -> None:
        if self._write_fence is not None:  # device copies out of slots freed since may still be queued
            self._write_fence.synchronize()
            self._write_fence = None
        self.pool(layout.slot_bytes).scatter(layout, slots, src)

    def fence_writes(self, event: Any) -> None:
        """Copies recorded before ``event`` (a CUDA event) may still read this tier's slots: the next write
        waits for them. The store's barrier sets it, so freeing a slot never blocks the CPU on the GPU."""
        if self.space == HOST:
            self._write_fence = event

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` of staging against the budget; False if it does not fit even after trimming.

        Empty chunks are released first to make room; chunks that hold blocks are the caller's to evacuate.
        """
        dropped = False
        while self.allocated_bytes + nbytes > self.budget and self._drop_an_empty_chunk():
            dropped = True
        if dropped:
            self.accel.release_cached()  # the freed chunk must not stay reserved beside the staging it makes room for
        if self.allocated_bytes + nbytes > self.budget:
            return False
        self.reserved += nbytes
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return True

    def unreserve(self, nbytes: int) -> None:
        """Give back ``nbytes`` of staging counted by :meth:`reserve`."""
        self.reserved -= nbytes

    # ------------------------------------------------------------------- evacuation (making room for staging)
    def evacuation(self) -> tuple[int, range] | None:
        """The chunk to empty next when a reservation does not fit: ``(slot_bytes, slot ids)`` of the newest chunk
        of the pool that holds the most bytes; None when no pool holds a chunk."""
        pools = [pool for pool in self.pools.values() if pool.chunks]
        if not pools:
            return None
        pool = max(pools, key=lambda pool: pool.allocated_bytes)
        return pool.slot_bytes, pool.last_chunk_slots()

    def alloc_outside(self, slot_bytes: int, avoid: range) -> int | None:
        """A free slot of the pool's chunks outside ``avoid`` (the chunk being emptied); the pool does not grow:
        an evacuation makes room, it takes none. None: every free slot is in ``avoid``."""
        pool = self.pools[slot_bytes]
        slot = pool.alloc()
        if slot is not None and slot in avoid:  # the lowest free slot is in the newest chunk: none is outside it
            pool.free(slot)
            return None
        return slot

    def copy_slot(self, slot_bytes: int, source: int, target: int) -> None:
        """Copy slot ``source``'s bytes into slot ``target`` (relocating a block within the tier)."""
        pool = self.pools[slot_bytes]
        pool.view(target).copy_(pool.view(source))

    def drop_chunk(self, slot_bytes: int) -> int:
        """Give back the newest chunk of the pool for ``slot_bytes``, whose slots must all be free; return the
        bytes released."""
        return self.pools[slot_bytes].drop_last_chunk()

    def _drop_an_empty_chunk(self) -> bool:
        for pool in self.pools.values():
            if pool.last_chunk_is_empty():
                pool.drop_last_chunk()
                return True
        return False

    def free_all(self) -> None:
        """Every slot free (a reset); the chunks and the staging reservations stay."""
        for pool in self.pools.values():
            pool.free_all()

    def slot_counts(self) -> dict[int, int]:
        return {slot_bytes: pool.used for slot_bytes, pool in self.pools.items()}

    def release_unheld(self, held: Mapping[int, Collection[int]]) -> int:
        return sum(pool.release_unheld(held.get(slot_bytes, ())) for slot_bytes, pool in self.pools.items())

    def close(self) -> None:
        self.pools.clear()
        self.reserved = 0
        if self.space == DEVICE:
            self.accel.release_cached()  # the slabs go back to the driver, not to the caching allocator


def joined_slabs(slabs: Sequence[list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[int]]:
    """Tiers' slab chunks (each :meth:`MemoryTier.slabs`) concatenated in that order, and each tier's first slot
    id in them: one table over several tiers, for a kernel that reads them in place (a tier's slot ids offset by
    the slots of the tiers before it). No Python per chunk."""
    chunks: list[torch.Tensor] = []
    firsts: list[int] = []
    for tier_chunks in slabs:  # a tier or two
        firsts.append(sum(map(torch.Tensor.size, chunks, repeat(0))))
        chunks += tier_chunks
    return chunks, firsts


class _MemoryRead:
    """A memory tier's read: nothing to wait for; ``finish`` gathers."""

    def __init__(self, pool: SlabPool, layout: BlockLayout | SlotBytes, slots: np.ndarray,
                 scratch: Scratch | None, memo: dict | None) -> None:
        self.pool, self.layout, self.slots, self.scratch, self.memo = pool, layout, slots, scratch, memo

    def finish(self, dests: Sequence[Dest]) -> None:
        landing = self.scratch.landing() if self.scratch is not None else None
        self.pool.gather(self.layout, self.slots, dests, landing, self.memo)

    def settle(self) -> None:
        pass


def _runs(chunks: np.ndarray, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Maximal ``(a, b, chunk)`` ranges of ``[lo, hi)`` whose slots all live in one chunk."""
    if hi <= lo:
        return []
    part = chunks[lo:hi]
    cuts = np.flatnonzero(part[1:] != part[:-1]) + 1
    starts = [0, *cuts.tolist()]
    ends = [*cuts.tolist(), hi - lo]
    return [(lo + a, lo + b, int(part[a])) for a, b in zip(starts, ends)]


def _consecutive(chunks: np.ndarray, rows: np.ndarray, lo: int, hi: int) -> list[tuple[int, int]]:
    """Maximal ``(a, b)`` ranges of ``[lo, hi)`` whose slots are consecutive rows of one chunk."""
    if hi <= lo:
        return []
    breaks = (np.diff(rows[lo:hi]) != 1) | (np.diff(chunks[lo:hi]) != 0)
    cuts = (np.flatnonzero(breaks) + 1).tolist()
    return [(lo + a, lo + b) for a, b in zip([0, *cuts], [*cuts, hi - lo])]


def _index_select(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    torch.index_select(src, 0, index, out=out)
