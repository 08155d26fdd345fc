"""Placement: which tier a block lives on, and moving blocks down the tier chain when a tier is full.

Rules (see docs/architecture.md):

- New blocks go to the fastest tier with a free slot, following the chain (device, host, disk).
- The tail block of every (row, layer) — the one still being filled — lives on the device, so a decode
  step's new token is written where attention reads it.
- When a tier is full, the policy picks victims that move down to the next tier of the chain that can
  take them (a tier with no room at all is skipped, so ``cpu_gb=0`` with a disk tier works); nothing is
  ever dropped. In exact mode blocks never move up (everything is read every step anyway); sparse attention
  moves the blocks its policy rates hot up to the device (:meth:`BlockPlacement.raise_to_device`).
- Staging (executors' buffers) is reserved against the device budget; to make room, the device tier names a
  chunk to evacuate (the newest of its fullest pool), placement demotes or relocates its blocks, and the tier
  gives the chunk back.

Errors carry numbers (budgets, what is held, the minimum); the adapter adds the user's words.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np
import torch

from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Block, BlockTable, Tier
from tierkv.errors import BudgetTooSmallError, CapacityError
from tierkv.layout import BlockLayout
from tierkv.policy import Policy
from tierkv.staging import device_minimum
from tierkv.store.transfer import Transfer, link
from tierkv.store.writeback import Writeback
from tierkv.tiers.base import StorageTier
from tierkv.tiers.memory import MemoryTier
from tierkv.units import plural


class BlockPlacement:
    """Where blocks go and how they move between tiers, for one store: its tiers (fastest first), table and
    policy; it copies through the store's :class:`~tierkv.store.transfer.Transfer` and waits for readers with
    its ``barrier``."""

    def __init__(self, tiers: Mapping[Tier, StorageTier], table: BlockTable, policy: Policy, transfer: Transfer,
                 writeback: Writeback, barrier: Callable[[], None],
                 on_moved: Callable[[Block, Tier, Tier], None]) -> None:
        self.tiers = tiers
        self.chain = tuple(tiers)  # fastest first
        self.table, self.policy, self.transfer, self.writeback = table, policy, transfer, writeback
        self.barrier, self.on_moved = barrier, on_moved
        self.promoted = 0  # blocks moved up to the device (sparse attention's promotions)
        # device reservations that are only caches (sparse attention's kept units): when the device has nothing
        # left to evacuate, each gives back what it holds (returning whether it held anything) before a refusal
        self.yielding: list[Callable[[], bool]] = []

    def give_way(self) -> bool:
        """Ask every cache-only reservation to give its device bytes back; whether any did."""
        return any([release() for release in list(self.yielding)])

    @property
    def device(self) -> MemoryTier:
        device = self.tiers[self.chain[0]]
        assert isinstance(device, MemoryTier)
        return device

    def below(self, tier: Tier) -> tuple[Tier, ...]:
        return self.chain[self.chain.index(tier) + 1 :]

    # ------------------------------------------------------------------------------------ allocation
    def alloc_top_down(self, slot_bytes: int, near: tuple[int, int]) -> tuple[Tier, int]:
        """The fastest tier's free slot for the block at ``near=(layer, index)``."""
        for tier in self.chain:
            slot = self._alloc(tier, slot_bytes, near)
            if slot is not None:
                return tier, slot
        raise self.capacity_error()

    def alloc_device(self, slot_bytes: int, protect: Collection[int], near: tuple[int, int]) -> int:
        """A device slot, demoting a victim down the chain when the device is full."""
        slot = self.device.alloc(slot_bytes, near)
        while slot is None:
            try:
                self.demote_victims(self.chain[0], slot_bytes, 1, protect)
            except BudgetTooSmallError:
                if not self.give_way():  # no block to move down, and no cache to drop: the budget is too small
                    raise
            slot = self.device.alloc(slot_bytes, near)
        return slot

    def _alloc(self, tier: Tier, slot_bytes: int, near: tuple[int, int]) -> int | None:
        slot = self.tiers[tier].alloc(slot_bytes, near)
        if slot is None and tier == Tier.HOST and self.writeback.reap(wait=True):
            slot = self.tiers[tier].alloc(slot_bytes, near)  # the write-back in flight just made room
        return slot

    def open_tails(self) -> set[int]:
        """Ids of last blocks still being filled: they must stay on the device. O(layers x rows)."""
        tails: set[int] = set()
        for layer, rows in self.table.rows.items():
            if rows.count and self.table.tail(layer).tokens < self.table.block_tokens:
                tails.update(rows.ids[:, -1].tolist())
        return tails

    # -------------------------------------------------------------------------------------- demotion
    def demote_victims(self, tier: Tier, slot_bytes: int, count: int, protect: Collection[int]) -> None:
        if tier == Tier.HOST and self.writeback.reap(wait=True):
            return  # the write-back in flight made room; the caller allocates again
        exclude = set(protect) | (self.open_tails() if tier == self.chain[0] else set())
        victims = self.policy.victims(tier, slot_bytes, count, exclude)
        if not victims:
            if tier == self.chain[0]:
                raise self._tails_error(slot_bytes, len(exclude))
            raise self.capacity_error()
        self.demote(victims)

    def demote(self, blocks: list[Block]) -> None:
        """Move ``blocks`` (all on one tier, one slot size) down the chain, making room there first."""
        source, slot_bytes = blocks[0].tier, blocks[0].slot_bytes
        self.barrier()
        remaining = sorted(blocks, key=in_sequence_order)
        while remaining:
            target, slots = self._room_below(source, slot_bytes, remaining, {b.id for b in remaining})
            batch, remaining = remaining[: len(slots)], remaining[len(slots) :]
            self._commit_demotion(batch, source, target, slots)

    def demote_any(self, blocks: list[Block]) -> None:
        """Move ``blocks`` one step down the chain, per (tier, slot size) group; blocks already on the lowest tier
        stay where they are."""
        groups: dict[tuple[Tier, int], list[Block]] = {}
        for block in blocks:
            if block.tier != self.chain[-1]:
                groups.setdefault((block.tier, block.slot_bytes), []).append(block)
        for (tier, _), group in sorted(groups.items(), key=lambda item: -item[0][0]):  # lowest tier first:
            still = [block for block in group if block.tier == tier]  # a cascade only pushes lower blocks down
            if still:
                self.demote(still)

    def _room_below(self, source: Tier, slot_bytes: int, blocks: list[Block],
                    protect: set[int]) -> tuple[Tier, list[int]]:
        """Free slots for (a prefix of) ``blocks`` on the first tier below ``source`` that can take them,
        pushing that tier's own victims further down when it is full; tiers with no room are skipped."""
        for target in self.below(source):
            slots = self._alloc_many(target, slot_bytes, blocks)
            if slots:
                return target, slots
            if self.below(target) and self.policy.victims(target, slot_bytes, 1, protect):
                self.demote_victims(target, slot_bytes, len(blocks), protect)
                slots = self._alloc_many(target, slot_bytes, blocks)
                if slots:
                    return target, slots
        raise self.capacity_error()

    def _alloc_many(self, tier: Tier, slot_bytes: int, blocks: list[Block]) -> list[int]:
        """Slots on ``tier`` for the first blocks of ``blocks`` (each next to its layer's last one)."""
        slots: list[int] = []
        try:
            for block in blocks:
                slot = self._alloc(tier, slot_bytes, (block.layer, block.index))
                if slot is None:
                    break
                slots.append(slot)
        except BaseException:  # a full disk, or an interrupt: the slots taken so far go back
            with deferred_interrupts():
                for slot in slots:
                    self.tiers[tier].free(slot_bytes, slot)
            raise
        return slots

    def _commit_demotion(self, blocks: list[Block], source: Tier, target: Tier, slots: list[int]) -> None:
        """Copy ``blocks`` into ``slots`` of ``target``, then retarget them and free their old slots."""
        slot_bytes = blocks[0].slot_bytes
        try:
            self.transfer.copy_slots(slot_bytes, source, [b.slot for b in blocks], target, slots)
        except BaseException:
            with deferred_interrupts():
                for slot in slots:
                    self.tiers[target].free(slot_bytes, slot)
            raise
        with deferred_interrupts():  # every block moves, or none
            for block, slot in zip(blocks, slots):
                self.tiers[source].free(slot_bytes, block.slot)
                self.table.place(block, target, slot)
                self.policy.on_move(block, source)
        for block in blocks:
            self.on_moved(block, source, target)

    # ------------------------------------------------------------------------------------- promotion
    def free_device_slots(self, slot_bytes: int, n: int) -> list[int]:
        """Up to ``n`` free device slots, allocated (fewer when the device is full: nothing is demoted)."""
        slots: list[int] = []
        while len(slots) < n:
            slot = self.device.alloc(slot_bytes)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def raise_to_device(self, layout: BlockLayout, blocks: list[Block], slots: list[int], data: torch.Tensor) -> None:
        """Move ``blocks`` (off-device, one layer) into device ``slots``, writing their bytes ``data``
        ``[n, 2, H_kv, block_tokens, D]`` (already on the device) with one batched write; their old slots are
        freed. The slots are the caller's to give back if this fails."""
        self.barrier()  # the old slots are freed below: no read of them may be in flight
        self.device.write_from(layout, np.asarray(slots, dtype=np.int64), data, self.transfer.scratch)
        with deferred_interrupts():
            for block, slot in zip(blocks, slots):
                source = block.tier
                self.tiers[source].free(block.slot_bytes, block.slot)
                self.table.place(block, self.chain[0], slot)
                self.policy.on_move(block, source)
            self.promoted += len(blocks)
        self.transfer.count(link(self.chain[0], self.chain[0]), sum(b.tokens for b in blocks) * layout.token_bytes)

    # --------------------------------------------------------------------------------------- staging
    def reserve_device(self, nbytes: int) -> None:
        """Count ``nbytes`` of device staging against the device budget, evacuating blocks to make room."""
        device = self.device
        try:
            while not device.reserve(nbytes):
                chunk = device.evacuation()
                try:
                    if chunk is None:
                        raise BudgetTooSmallError("no blocks left to evacuate")
                    self._evacuate(*chunk)
                except BudgetTooSmallError:
                    if not self.give_way():  # no cache gave its bytes back either
                        raise
        except BudgetTooSmallError:  # "no blocks left to evacuate" adds nothing to the numbers below
            raise self._staging_error(nbytes) from None

    def _staging_error(self, nbytes: int) -> BudgetTooSmallError:
        """Staging of ``nbytes`` more does not fit: the numbers, the minimum that would, and the ways out."""
        device = self.device
        staging = device.reserved + nbytes
        slot = max(device.slot_sizes(), default=0)
        tails = (len(self.open_tails()) + 1) * slot
        need = device_minimum(staging, tails)
        return BudgetTooSmallError(
            f"the device budget ({_size(device.budget)}) cannot hold the attention staging area ({_size(staging)}) "
            f"beside the blocks being filled ({_size(tails)}); with slab chunks of up to 1/16 of the budget that "
            f"takes {_size(need)}: raise gpu_gb to at least that."
        )  # the cache (tierkv.hf.runtime.budget_error) adds the minimum of its mode and the way out of it

    def _blocks_on(self, tier: Tier, slot_bytes: int, slots: range) -> list[Block]:
        """Live blocks of ``tier`` and ``slot_bytes`` whose slot is in ``slots`` (vectorised over the grids)."""
        ids: set[int] = set()
        for rows in self.table.rows.values():
            held = (rows.tiers == tier) & (rows.slots >= slots.start) & (rows.slots < slots.stop)
            ids.update(np.unique(rows.ids[held]).tolist())
        blocks = (self.table.blocks[i] for i in ids)
        return sorted((b for b in blocks if b.slot_bytes == slot_bytes), key=lambda b: b.id)

    def _evacuate(self, slot_bytes: int, chunk: range) -> None:
        """Empty the device chunk holding slots ``chunk`` and give it back. As many blocks move down as the chunk
        holds, but the policy's victims over the whole tier, not whatever the chunk holds: a block of the chunk
        that is not among them takes the slot of one outside it that is (a copy within the device); open tails
        are relocated within the device."""
        self.barrier()
        device, top = self.device, self.chain[0]
        tails = self.open_tails()
        on_chunk = self._blocks_on(top, slot_bytes, chunk)
        movable = [b for b in on_chunk if b.id not in tails]
        coldest = {b.id: b for b in self.policy.victims(top, slot_bytes, len(movable), tails)} if movable else {}
        outside = [b for b in coldest.values() if b.slot not in chunk]
        staying = [b for b in movable if b.id not in coldest][: len(outside)]
        kept = {b.id for b in staying}
        if movable:
            self.demote([b for b in movable if b.id not in kept] + outside[: len(staying)])
        for block in staying + [b for b in on_chunk if b.id in tails]:
            slot = device.alloc_outside(slot_bytes, chunk)
            if slot is None:
                self.demote_victims(top, slot_bytes, 1, protect={b.id for b in on_chunk})
                slot = device.alloc_outside(slot_bytes, chunk)
                if slot is None:
                    raise BudgetTooSmallError(
                        f"the device budget ({_size(device.budget)}) cannot hold the attention staging area "
                        f"({_size(device.reserved)}) and the blocks being filled; raise gpu_gb "
                        "(see TieredCache.min_device_bytes)."
                    )
            device.copy_slot(slot_bytes, block.slot, slot)
            with deferred_interrupts():
                device.free(slot_bytes, block.slot)
                self.table.place(block, top, slot)
        device.drop_chunk(slot_bytes)

    # ---------------------------------------------------------------------------------------- errors
    def _tails_error(self, slot_bytes: int, tails: int) -> BudgetTooSmallError:
        device = self.device
        need = device.reserved + (tails + 1) * slot_bytes
        return BudgetTooSmallError(
            f"the device budget ({_size(device.budget)}) cannot hold the attention staging area "
            f"({_size(device.reserved)}) plus {plural(tails + 1, 'block')} being filled "
            f"({_size((tails + 1) * slot_bytes)}): at least {_size(need)} (gpu_gb=\"{need}B\") is needed; raise gpu_gb "
            "(TieredCache.min_device_bytes; inside cache.streaming / split / sparse: min_streaming_device_bytes, "
            "min_split_device_bytes, min_sparse_device_bytes) or lower block_tokens."
        )

    def capacity_error(self) -> CapacityError:
        held = ", ".join(f"{tier.label} {_size(self.tiers[tier].used_bytes)} of {_size(self.tiers[tier].budget)}"
                         for tier in self.chain)
        last = self.chain[-1]
        fix = ("raise disk_gb (or free space under disk_dir)" if last == Tier.DISK
               else "raise cpu_gb, or pass disk_dir= to add a disk tier")
        return CapacityError(f"the KV cache no longer fits in its budgets (KV held: {held}); {fix}.")


def _size(nbytes: int) -> str:
    """Bytes for a message, in the largest decimal unit that keeps a digit before the point."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes} B"


def in_sequence_order(block: Block) -> tuple[int, int]:
    """Blocks moved together get consecutive slots in this order, so a layer's blocks sit side by side on
    the lower tier and its later reads coalesce into few large requests (one per run of slots)."""
    return block.layer, block.index
