"""The KV block store: the block table, three tier pools and the policy, kept consistent together.

It knows nothing about transformers. Its callers append K/V per layer, plan reads of token ranges and
execute them into a destination tensor; it decides where every block lives.

Placement rules (see docs/architecture.md):

- New blocks go to the fastest tier with a free slot (device, then host, then disk).
- The tail block of every (row, layer) — the one still being filled — lives on the device, so a decode
  step's new token is written where attention reads it.
- When a tier is full, the policy picks victims that move one tier down; nothing is ever dropped.
  Blocks never move up: in exact mode everything is read every step anyway, so promotion would only
  ping-pong. Full blocks are immutable, so a block written to a lower tier is never written again.
- Every change is transactional: an append that fails (disk full, budget exhausted) leaves the table as
  it was, and every token accepted before it still reads back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from tierkv.blocks import Block, BlockTable, Tier
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError, TierKVError
from tierkv.layout import BlockLayout
from tierkv.policy import Policy
from tierkv.tiers.disk import BounceBuffer, DiskTier, disk_error
from tierkv.tiers.memory import MemoryTier, SlabPool
from tierkv.writeback import Writeback

LINKS = ("device->device", "device->host", "host->device", "host->disk", "device->disk", "disk->device")


@dataclass(slots=True)
class RowAppend:
    """How one row takes an append: tokens written into its open device tail where it is, then new blocks
    (the first one a copy of the old tail when ``replaces_tail``), each with its final token count."""

    in_place: int = 0
    replaces_tail: bool = False
    new_blocks: list[tuple[Block, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReadSegment:
    """``length`` tokens of one block, from token ``src`` of the block to token ``dst`` of the destination."""

    row: int
    block_id: int
    tier: Tier
    slot: int
    slot_bytes: int
    src: int
    dst: int
    length: int


class KVStore:
    """Blocks of K/V for every (row, layer), spread over the device, host and disk tiers."""

    def __init__(self, device: MemoryTier, host: MemoryTier, disk: DiskTier | None, policy: Policy,
                 block_tokens: int) -> None:
        if block_tokens <= 0:
            raise InvalidConfigError(f"block_tokens must be positive, got {block_tokens}.")
        self.tiers: dict[Tier, MemoryTier | DiskTier] = {Tier.DEVICE: device, Tier.HOST: host}
        if disk is not None:
            self.tiers[Tier.DISK] = disk
        self.policy = policy
        self.block_tokens = block_tokens
        self.table = BlockTable()
        self.layouts: dict[int, BlockLayout] = {}
        self.bytes_moved = dict.fromkeys(LINKS, 0)
        self.tick = 0
        self.barrier: Callable[[], None] = lambda: None  # waits for in-flight reads before slots are reused
        self._stats_lock = threading.Lock()  # reads run on the mover thread
        pinned = device.device.type == "cuda"
        self._write_bounce = BounceBuffer(pin=pinned)
        # Reads run on the caller's thread and on the mover's: each gets its own bounce and landing buffer.
        self._owner = threading.get_ident()
        self._read_bounces = (BounceBuffer(pin=pinned), BounceBuffer(pin=pinned))
        self._landings: tuple[torch.Tensor, torch.Tensor] | None = None  # see enable_landing
        self.writeback = Writeback(self, pin=pinned)

    # ----------------------------------------------------------------------------------------- queries
    @property
    def device(self) -> MemoryTier:
        return self.tiers[Tier.DEVICE]  # type: ignore[return-value]

    def seq_length(self, layer: int) -> int:
        return self.table.seq_length(layer)

    def batch_size(self, layer: int) -> int:
        return len(self.table.layer_rows(layer))

    def block_view(self, block: Block) -> torch.Tensor:
        """A memory-resident block as ``[2, H_kv, block_tokens, D]`` (a view into its tier's slab)."""
        layout = self.layouts[block.layer]
        raw = self.tiers[block.tier].view(block.slot_bytes, block.slot)  # type: ignore[union-attr]
        return raw[: layout.block_bytes].view(layout.dtype).view(layout.shape)

    def _layer_blocks(self, tier: Tier, slot_bytes: int) -> list[Block]:
        return [b for b in self.table.blocks.values() if b.tier == tier and b.slot_bytes == slot_bytes]

    def _open_tails(self) -> set[int]:
        """Ids of last blocks still being filled: they must stay on the device."""
        tails = set()
        for rows in self.table.rows.values():
            for row in rows:
                if row and self.table.blocks[row[-1]].tokens < self.block_tokens:
                    tails.add(row[-1])
        return tails

    # ----------------------------------------------------------------------------------------- append
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, q, D]`` to every row of ``layer``. All or nothing."""
        layout = self._layout_for(layer, keys, values)
        batch, tokens = keys.shape[0], keys.shape[2]
        rows = self.table.rows.get(layer)
        if rows is None or not any(rows):
            rows = [[] for _ in range(batch)]
        elif len(rows) != batch:
            raise InvalidConfigError(
                f"layer {layer} holds {len(rows)} sequences but update() got a batch of {batch}; call "
                "cache.reset() before starting a new batch, or use reorder/select for beam search."
            )
        if layer == 0:
            self.tick += 1
        self.writeback.reap()
        kv = torch.stack((keys, values))  # [2, B, H_kv, q, D]
        allocated: list[Block] = []
        try:
            plans = self._plan_appends(layer, rows, tokens, layout, allocated)
            self._write_blocks(layout, self._row_writes(kv, rows, plans))
        except BaseException:
            for block in allocated:
                self._free_slot(block)
                del self.table.blocks[block.id]
            raise
        for row, plan in zip(rows, plans):
            if plan.in_place:
                self.table.blocks[row[-1]].tokens += plan.in_place
            blocks = list(plan.new_blocks)
            if plan.replaces_tail:
                block, count = blocks.pop(0)
                self._replace_tail(row, block, count)
            for block, count in blocks:
                block.tokens = count
                row.append(block.id)
                self.policy.on_insert(block, self.tick)
        self.table.rows[layer] = rows
        self.writeback.maybe_start()

    def _layout_for(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> BlockLayout:
        if keys.shape != values.shape:
            raise InvalidConfigError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape.")
        layout = BlockLayout.of(keys, self.block_tokens)
        known = self.layouts.setdefault(layer, layout)
        if known != layout:
            raise InvalidConfigError(
                f"layer {layer} changed geometry from {known} to {layout}; one TieredCache serves one model — "
                "create a new cache (or call reset()) for another model."
            )
        if keys.device != self.device.device:
            raise InvalidConfigError(
                f"layer {layer} keys are on {keys.device} but the cache's device tier is on {self.device.device}; "
                "keep the model on one device, or create the cache after moving the model."
            )
        return layout

    def _plan_appends(self, layer: int, rows: list[list[int]], tokens: int, layout: BlockLayout,
                      allocated: list[Block]) -> list[RowAppend]:
        """Allocate what each row needs for ``tokens`` more tokens.

        Each row's last new block becomes its open tail and must be on the device; those are allocated
        first, so the top-down placement of the other (full) new blocks cannot crowd them out.
        """
        plans, counts_of_rows = [], []
        for row in rows:
            plan = RowAppend()
            counts: list[int] = []
            remaining = tokens
            if row and (tail := self.table.blocks[row[-1]]).tokens < self.block_tokens:
                take = min(self.block_tokens - tail.tokens, tokens)
                if tail.refcount == 1 and tail.tier == Tier.DEVICE:
                    plan.in_place = take
                else:  # shared or demoted tail: copy it into a new block (copy-on-write)
                    plan.replaces_tail = True
                    counts.append(tail.tokens + take)
                remaining -= take
            while remaining > 0:
                counts.append(min(self.block_tokens, remaining))
                remaining -= counts[-1]
            plans.append(plan)
            counts_of_rows.append(counts)
        tails = {r: self._new_block(layer, layout, allocated, on_device=True)
                 for r, counts in enumerate(counts_of_rows) if counts}
        for r, (plan, counts) in enumerate(zip(plans, counts_of_rows)):
            plan.new_blocks = [(self._new_block(layer, layout, allocated, on_device=False), n) for n in counts[:-1]]
            if counts:
                plan.new_blocks.append((tails[r], counts[-1]))
        return plans

    def _new_block(self, layer: int, layout: BlockLayout, allocated: list[Block], on_device: bool) -> Block:
        slot_bytes = layout.slot_bytes
        if on_device:
            protect = {b.id for b in allocated if b.tier == Tier.DEVICE}
            tier, slot = Tier.DEVICE, self._alloc_device(slot_bytes, protect)
        else:
            tier, slot = self._alloc_top_down(slot_bytes)
        block = self.table.new_block(layer, tier, slot, slot_bytes)
        allocated.append(block)
        return block

    def _row_writes(self, kv: torch.Tensor, rows: list[list[int]],
                    plans: list[RowAppend]) -> list[tuple[Block, int, torch.Tensor]]:
        """(block, first token, data ``[2, H_kv, n, D]``) for every write an append makes."""
        writes = []
        for b, (row, plan) in enumerate(zip(rows, plans)):
            consumed = 0
            if plan.in_place:
                tail = self.table.blocks[row[-1]]
                writes.append((tail, tail.tokens, kv[:, b, :, : plan.in_place]))
                consumed = plan.in_place
            for i, (block, count) in enumerate(plan.new_blocks):
                if i == 0 and plan.replaces_tail:
                    old = self.table.blocks[row[-1]]
                    take = count - old.tokens
                    kept = self._read_block(old)[:, :, : old.tokens].to(kv.device)
                    data = torch.cat((kept, kv[:, b, :, :take]), dim=2)
                    self._count(_link(old.tier, block.tier), old.tokens * self.layouts[old.layer].token_bytes)
                else:
                    take = count
                    data = kv[:, b, :, consumed : consumed + take]
                writes.append((block, 0, data))
                consumed += take
        return writes

    def _write_blocks(self, layout: BlockLayout, writes: list[tuple[Block, int, torch.Tensor]]) -> None:
        """Copy data into memory blocks directly and into disk blocks with one batched write."""
        to_disk = []
        for block, start, data in writes:
            if block.tier == Tier.DISK:
                to_disk.append((block, data))
                continue
            self.block_view(block)[:, :, start : start + data.shape[2]].copy_(data)
            if block.tier != Tier.DEVICE:
                self._count("device->host", data.shape[2] * layout.token_bytes)
        if not to_disk:
            return
        slot_bytes = layout.slot_bytes
        bounce = self._write_bounce.get(len(to_disk) * slot_bytes)
        staged = torch.from_numpy(bounce)
        for i, (_, data) in enumerate(to_disk):
            part = staged[i * slot_bytes : i * slot_bytes + layout.block_bytes].view(layout.dtype).view(layout.shape)
            part[:, :, : data.shape[2]].copy_(data)
        self._disk_io(slot_bytes, [block.slot for block, _ in to_disk], bounce, write=True)
        self._count("device->disk", sum(data.shape[2] for _, data in to_disk) * layout.token_bytes)

    def _replace_tail(self, row: list[int], new_tail: Block, tokens: int) -> None:
        old = self.table.blocks[row[-1]]
        new_tail.tokens = tokens
        row[-1] = new_tail.id
        self.policy.on_insert(new_tail, self.tick)
        released = self.table.release(old.id)
        if released is not None:
            self._free_slot(released)

    # ------------------------------------------------------------------------------------ allocation
    def _alloc_top_down(self, slot_bytes: int) -> tuple[Tier, int]:
        for tier in self.tiers:
            slot = self.tiers[tier].alloc(slot_bytes)
            if slot is None and tier == Tier.HOST and self.writeback.reap(wait=True):
                slot = self.tiers[tier].alloc(slot_bytes)  # the write-back in flight just made room
            if slot is not None:
                return tier, slot
        raise self._capacity_error()

    def _alloc_device(self, slot_bytes: int, protect: set[int]) -> int:
        """A device slot, demoting a victim down a tier when the device is full."""
        slot = self.device.alloc(slot_bytes)
        while slot is None:
            self._demote_victims(Tier.DEVICE, slot_bytes, 1, protect)
            slot = self.device.alloc(slot_bytes)
        return slot

    def _demote_victims(self, tier: Tier, slot_bytes: int, count: int, protect: set[int]) -> None:
        if tier == Tier.HOST and self.writeback.reap(wait=True):
            return  # the write-back in flight made room; the caller allocates again
        pinned = protect | (self._open_tails() if tier == Tier.DEVICE else self.writeback.pending_ids)
        candidates = [b for b in self._layer_blocks(tier, slot_bytes) if b.id not in pinned]
        victims = self.policy.victims(candidates, count)
        if not victims:
            if tier == Tier.DEVICE:
                raise BudgetTooSmallError(
                    f"the device budget ({self.device.budget / 1e6:.2f} MB) cannot even hold the blocks being "
                    f"filled ({len(pinned)} tail blocks of {slot_bytes} bytes) plus the attention staging area "
                    f"({self.device.reserved / 1e6:.2f} MB); raise gpu_gb (see TieredCache.min_device_bytes) or "
                    "lower block_tokens."
                )
            raise self._capacity_error()
        self._demote(victims)

    def _demote(self, blocks: list[Block]) -> None:
        """Move ``blocks`` (all on one tier, one slot size) one tier down, making room there first."""
        source = blocks[0].tier
        if source + 1 not in self.tiers:
            raise self._capacity_error()
        target = Tier(source + 1)
        slot_bytes = blocks[0].slot_bytes
        self.barrier()
        remaining = list(blocks)
        while remaining:
            slots: list[int] = []
            while len(slots) < len(remaining) and (slot := self.tiers[target].alloc(slot_bytes)) is not None:
                slots.append(slot)
            if not slots:  # the target is full: push its own victims further down first
                self._demote_victims(target, slot_bytes, len(remaining), protect={b.id for b in remaining})
                continue
            batch, remaining = remaining[: len(slots)], remaining[len(slots) :]
            self._commit_demotion(batch, source, target, slots)

    def _commit_demotion(self, blocks: list[Block], source: Tier, target: Tier, slots: list[int]) -> None:
        """Copy ``blocks`` into ``slots`` of ``target``, then retarget them and free their old slots."""
        slot_bytes = blocks[0].slot_bytes
        try:
            self._copy_down(blocks, target, slots)
        except BaseException:
            for slot in slots:
                self.tiers[target].free(slot_bytes, slot)
            raise
        for block, slot in zip(blocks, slots):
            self.tiers[source].free(slot_bytes, block.slot)
            block.tier, block.slot = target, slot
            self._count(_link(source, target), block.tokens * self.layouts[block.layer].token_bytes)

    def _copy_down(self, blocks: list[Block], target: Tier, slots: list[int]) -> None:
        slot_bytes = blocks[0].slot_bytes
        if target != Tier.DISK:
            for block, slot in zip(blocks, slots):
                self.tiers[target].view(slot_bytes, slot).copy_(  # type: ignore[union-attr]
                    self.tiers[block.tier].view(slot_bytes, block.slot))  # type: ignore[union-attr]
            return
        bounce = self._write_bounce.get(len(blocks) * slot_bytes)
        staged = torch.from_numpy(bounce).view(len(blocks), slot_bytes)
        for i, block in enumerate(blocks):
            staged[i].copy_(self.tiers[block.tier].view(slot_bytes, block.slot))  # type: ignore[union-attr]
        self._disk_io(slot_bytes, slots, bounce, write=True)

    def _disk_io(self, slot_bytes: int, slots: list[int], buffer: np.ndarray, write: bool) -> None:
        disk: DiskTier = self.tiers[Tier.DISK]  # type: ignore[assignment]
        try:
            handle = disk.write(slot_bytes, slots, buffer) if write else disk.read(slot_bytes, slots, buffer)
            handle.wait()
        except TierKVError:
            raise
        except OSError as exc:
            raise disk_error(exc, disk.files[slot_bytes].path) from exc

    def _count(self, link: str, nbytes: int) -> None:
        with self._stats_lock:
            self.bytes_moved[link] = self.bytes_moved.get(link, 0) + nbytes

    def _free_slot(self, block: Block) -> None:
        self.barrier()
        self.tiers[block.tier].free(block.slot_bytes, block.slot)

    def _capacity_error(self) -> CapacityError:
        budgets = ", ".join(f"{tier.label} {self.tiers[tier].budget / 1e9:.3f} GB" for tier in self.tiers)
        fix = "raise cpu_gb or disk_gb" if Tier.DISK in self.tiers else \
            "raise cpu_gb or pass disk_dir= to add a disk tier"
        return CapacityError(f"the KV cache no longer fits in its budgets ({budgets}); {fix}.")

    # ----------------------------------------------------------------------------------------- reads
    def plan_read(self, layer: int, start: int, stop: int) -> list[ReadSegment]:
        """Segments that cover tokens ``[start, stop)`` of every row of ``layer``; records the access."""
        segments = []
        for r, row in enumerate(self.table.layer_rows(layer)):
            offset = 0
            for block_id in row:
                block = self.table.blocks[block_id]
                lo, hi = max(start, offset), min(stop, offset + block.tokens)
                if lo < hi:
                    segments.append(ReadSegment(r, block.id, block.tier, block.slot, block.slot_bytes,
                                                lo - offset, lo - start, hi - lo))
                    self.policy.on_access(block, self.tick)
                offset += block.tokens
        return segments

    def read_into(self, layer: int, segments: Iterable[ReadSegment], dest: torch.Tensor) -> None:
        """Copy ``segments`` of ``layer`` into ``dest`` ``[2, B, H_kv, >= tokens, D]`` on the device.

        Device blocks are copied directly. Host blocks in consecutive slots of one slab chunk form a *run*,
        and disk blocks arrive as one coalesced read into the bounce buffer; with a landing buffer (CUDA),
        each run crosses the link as one large copy and is scattered into ``dest`` on the device.
        """
        layout = self.layouts[layer]
        from_host, from_disk = [], []
        for seg in segments:
            if seg.tier == Tier.DEVICE:
                self._copy_segment(layout, self.device.view(seg.slot_bytes, seg.slot), seg, dest)
            else:
                (from_host if seg.tier == Tier.HOST else from_disk).append(seg)
        if from_host:
            host: MemoryTier = self.tiers[Tier.HOST]  # type: ignore[assignment]
            pool = host.pools[layout.slot_bytes]
            from_host.sort(key=lambda seg: seg.slot)
            for run_start, run in _runs(from_host, pool):
                rows = pool.rows(run_start.slot, run[-1].slot - run_start.slot + 1)
                self._scatter(layout, rows, [(seg.slot - run_start.slot, seg) for seg in run], dest)
        if from_disk:
            self._read_disk_segments(layout, from_disk, dest)

    def enable_landing(self, nbytes: int) -> bool:
        """Reserve a device landing buffer so host and disk runs cross the link as large copies.

        Worth it where a copy has a fixed cost and scattered destinations are slow to reach (CUDA: ~2 µs
        per copy, pageable or strided copies through hidden temporaries). False if the budget has no room.
        """
        if self._landings is not None:
            return True
        try:
            self.reserve_device(2 * nbytes)  # one for the caller's thread, one for the mover's
        except BudgetTooSmallError:
            return False
        self._landings = tuple(torch.empty(nbytes, dtype=torch.uint8, device=self.device.device) for _ in range(2))
        return True

    def _scratch(self) -> int:
        """0 on the thread that owns the store, 1 on the mover's: which bounce/landing buffer to use."""
        return 0 if threading.get_ident() == self._owner else 1

    def _copy_segment(self, layout: BlockLayout, raw: torch.Tensor, seg: ReadSegment, dest: torch.Tensor) -> None:
        source = raw[: layout.block_bytes].view(layout.dtype).view(layout.shape)
        dest[:, seg.row, :, seg.dst : seg.dst + seg.length].copy_(
            source[:, :, seg.src : seg.src + seg.length], non_blocking=True)
        self._count(_link(seg.tier, Tier.DEVICE), seg.length * layout.token_bytes)

    def _scatter(self, layout: BlockLayout, rows: torch.Tensor, items: list[tuple[int, ReadSegment]],
                 dest: torch.Tensor) -> None:
        """Copy segments out of ``rows`` ``[n, slot_bytes]`` (host bytes) into ``dest``, via the landing buffer
        in pieces of its capacity when there is one."""
        if self._landings is None:
            for index, seg in items:
                self._copy_segment(layout, rows[index], seg, dest)
            return
        own = self._landings[self._scratch()]
        capacity = own.numel() // layout.slot_bytes
        if capacity == 0:
            raise BudgetTooSmallError("the landing buffer is smaller than one block; raise gpu_gb.")
        landing = own[: capacity * layout.slot_bytes].view(capacity, layout.slot_bytes)
        for first in range(0, rows.shape[0], capacity):
            piece = rows[first : first + capacity]
            landing[: piece.shape[0]].copy_(piece, non_blocking=True)
            for index, seg in items:
                if first <= index < first + piece.shape[0]:
                    self._copy_segment(layout, landing[index - first], seg, dest)

    def _read_disk_segments(self, layout: BlockLayout, segments: list[ReadSegment], dest: torch.Tensor) -> None:
        slot_bytes = layout.slot_bytes
        order = sorted(range(len(segments)), key=lambda i: segments[i].slot)  # ascending: runs coalesce
        bounce = self._read_bounces[self._scratch()].get(len(segments) * slot_bytes)
        self._disk_io(slot_bytes, [segments[i].slot for i in order], bounce, write=False)
        rows = torch.from_numpy(bounce).view(len(segments), slot_bytes)
        self._scatter(layout, rows, [(position, segments[i]) for position, i in enumerate(order)], dest)
        if dest.is_cuda:  # the copies out of the bounce buffer must land before the next read refills it
            torch.cuda.current_stream(dest.device).synchronize()

    def _read_block(self, block: Block) -> torch.Tensor:
        """A block's data as ``[2, H_kv, block_tokens, D]`` wherever it lives (disk blocks are read)."""
        if block.tier != Tier.DISK:
            return self.block_view(block)
        layout = self.layouts[block.layer]
        out = torch.empty(layout.shape, dtype=layout.dtype, device=self.device.device)
        segment = ReadSegment(0, block.id, block.tier, block.slot, block.slot_bytes, 0, 0, block.tokens)
        self._read_disk_segments(layout, [segment], out.unsqueeze(1))
        return out

    def read_tokens(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A fresh ``[2, B, H_kv, stop - start, D]`` copy of a token range (for tests and tools, not decode)."""
        stop = self.seq_length(layer) if stop is None else stop
        layout = self.layouts[layer]
        out = torch.empty((2, self.batch_size(layer), layout.kv_heads, stop - start, layout.head_dim),
                          dtype=layout.dtype, device=self.device.device)
        self.read_into(layer, self.plan_read(layer, start, stop), out)
        return out

    # ----------------------------------------------------------------------------------- table edits
    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` of every layer becomes old row ``indices[i]`` (beam reorder, batch selection)."""
        self.barrier()
        for layer in list(self.table.rows):
            for block in self.table.select_rows(layer, indices):
                self._free_slot(block)

    def crop(self, layer: int, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` tokens of every row of ``layer``."""
        self._trim(layer, tokens_to_remove, from_front=False)

    def drop_front(self, layer: int, whole_blocks_before: int) -> int:
        """Free whole blocks that end before token ``whole_blocks_before``; return the tokens dropped."""
        rows = self.table.layer_rows(layer)
        if not rows or not rows[0]:
            return 0
        dropped = 0
        for block_id in rows[0][:-1]:
            tokens = self.table.blocks[block_id].tokens
            if dropped + tokens > whole_blocks_before:
                break
            dropped += tokens
        if dropped:
            self._trim(layer, dropped, from_front=True)
        return dropped

    def _trim(self, layer: int, tokens: int, from_front: bool) -> None:
        """Remove ``tokens`` from the end (or whole blocks from the front) of every row. All or nothing:
        the copies a cut through a shared block needs are made before any row changes."""
        if tokens <= 0:
            return
        self.barrier()
        rows = self.table.layer_rows(layer)
        cuts = [self._plan_cut(row, tokens, from_front) for row in rows]  # (blocks to drop, tokens kept in next)
        allocated: list[Block] = []
        copies: dict[int, Block] = {}
        try:
            for r, (row, (drop, keep)) in enumerate(zip(rows, cuts)):
                if keep and self.table.blocks[row[-1 - drop]].refcount > 1:
                    copies[r] = self._copy_prefix(self.table.blocks[row[-1 - drop]], keep, allocated)
        except BaseException:
            for block in allocated:
                self._free_slot(block)
                del self.table.blocks[block.id]
            raise
        for r, (row, (drop, keep)) in enumerate(zip(rows, cuts)):
            for _ in range(drop):
                released = self.table.release(row.pop(0 if from_front else -1))
                if released is not None:
                    self._free_slot(released)
            if r in copies:
                released = self.table.release(row[-1])
                if released is not None:  # every row that shared it took a copy
                    self._free_slot(released)
                row[-1] = copies[r].id
            elif keep:
                self.table.blocks[row[-1]].tokens = keep

    def _plan_cut(self, row: list[int], tokens: int, from_front: bool) -> tuple[int, int]:
        """(whole blocks to drop, tokens the next block keeps — 0 if it is untouched) to remove ``tokens``."""
        order = row if from_front else row[::-1]
        remaining, drop = tokens, 0
        for block_id in order:
            held = self.table.blocks[block_id].tokens
            if held > remaining:
                if from_front and remaining:
                    raise InvalidConfigError("drop_front only drops whole blocks.")
                return drop, (held - remaining if remaining else 0)
            remaining -= held
            drop += 1
            if remaining == 0:
                return drop, 0
        return drop, 0

    def _copy_prefix(self, block: Block, keep: int, allocated: list[Block]) -> Block:
        """A new device block holding the first ``keep`` tokens of ``block`` (copy-on-write of a shared cut)."""
        layout = self.layouts[block.layer]
        copy = self._new_block(block.layer, layout, allocated, on_device=True)
        self.block_view(copy)[:, :, :keep].copy_(self._read_block(block)[:, :, :keep].to(self.device.device))
        self._count(_link(block.tier, Tier.DEVICE), keep * layout.token_bytes)
        copy.tokens = keep
        self.policy.on_insert(copy, self.tick)
        return copy

    # ------------------------------------------------------------------------------------ staging
    def reserve_device(self, nbytes: int) -> None:
        """Count ``nbytes`` of device staging against the device budget, evacuating blocks to make room."""
        while not self.device.reserve(nbytes):
            pool = self._fullest_pool()
            if pool is None:
                raise BudgetTooSmallError(
                    f"the device budget ({self.device.budget / 1e6:.2f} MB) is smaller than the attention staging "
                    f"area alone ({(self.device.reserved + nbytes) / 1e6:.2f} MB); raise gpu_gb (see "
                    "TieredCache.min_device_bytes)."
                )
            self._evacuate_last_chunk(pool)

    def _fullest_pool(self) -> SlabPool | None:
        pools = [pool for pool in self.device.pools.values() if pool.chunks]
        return max(pools, key=lambda pool: pool.allocated_bytes, default=None)

    def _evacuate_last_chunk(self, pool: SlabPool) -> None:
        """Empty the newest chunk of a device pool (demote its blocks, relocate open tails) and release it."""
        self.barrier()
        last = set(pool.last_chunk_slots())
        tails = self._open_tails()
        on_chunk = [b for b in self._layer_blocks(Tier.DEVICE, pool.slot_bytes) if b.slot in last]
        movable = [b for b in on_chunk if b.id not in tails]
        if movable:
            self._demote(movable)
        for block in (b for b in on_chunk if b.id in tails):
            slot = pool.alloc()
            if slot is not None and slot in last:
                pool.free(slot)
                slot = None
            if slot is None:
                self._demote_victims(Tier.DEVICE, pool.slot_bytes, 1, protect={b.id for b in on_chunk})
                slot = pool.alloc()
                if slot is None or slot in last:
                    raise BudgetTooSmallError(
                        f"the device budget ({self.device.budget / 1e6:.2f} MB) cannot hold the attention staging "
                        "area and the blocks being filled; raise gpu_gb (see TieredCache.min_device_bytes)."
                    )
            pool.view(slot).copy_(pool.view(block.slot))
            pool.free(block.slot)
            block.slot = slot
        pool.drop_last_chunk()

    # ------------------------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget every block; pools stay allocated for the next sequence."""
        self.barrier()
        self.writeback.reap(wait=True)
        self.writeback.resume()
        for block in list(self.table.blocks.values()):
            self.tiers[block.tier].free(block.slot_bytes, block.slot)
        self.table = BlockTable()
        self.layouts.clear()  # the next sequence may come from another model or dtype

    def close(self) -> None:
        self.barrier()
        self.writeback.reap(wait=True)
        self.table = BlockTable()
        for tier in self.tiers.values():
            if isinstance(tier, DiskTier):
                tier.close()
            else:
                tier.release_all()

    def stats(self) -> dict:
        blocks = {tier.label: 0 for tier in Tier}
        resident = {tier.label: 0 for tier in Tier}
        for block in self.table.blocks.values():
            blocks[block.tier.label] += 1
            resident[block.tier.label] += block.tokens * self.layouts[block.layer].token_bytes
        return {
            "bytes_resident": resident,
            "bytes_allocated": {tier.label: self.tiers[tier].allocated_bytes for tier in self.tiers},
            "peak_bytes_allocated": {tier.label: self.tiers[tier].peak_bytes for tier in self.tiers},
            "budget_bytes": {tier.label: self.tiers[tier].budget for tier in self.tiers},
            "bytes_staging": self.device.reserved,
            "bytes_moved": dict(self.bytes_moved),
            "writeback": {"pending_blocks": len(self.writeback.pending_ids), "paused": self.writeback.paused_reason},
            "blocks": blocks,
        }


def _link(source: Tier, target: Tier) -> str:
    return f"{source.label}->{target.label}"


def _runs(segments: list[ReadSegment], pool: SlabPool) -> Iterator[tuple[ReadSegment, list[ReadSegment]]]:
    """Group slot-sorted segments into runs of consecutive slots within one slab chunk."""
    run = [segments[0]]
    for seg in segments[1:]:
        if pool.contiguous(run[-1].slot, seg.slot):
            run.append(seg)
        else:
            yield run[0], run
            run = [seg]
    yield run[0], run
