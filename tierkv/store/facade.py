"""The KV block store: the block table, the tier chain and the policy, kept consistent together.

It knows nothing about transformers. Its callers append K/V per layer, plan reads of token ranges and
execute them into a destination tensor; it decides where every block lives (:mod:`.placement`), and moves
the bytes (:mod:`.transfer`).

Every change is transactional: an append that fails (disk full, budget exhausted) leaves the table as it
was, and every token accepted before it still reads back. Table edits that free or move slots first wait
for in-flight reads: executors register as *readers* (:meth:`KVStore.add_reader`) and the store's
:meth:`~KVStore.barrier` waits for them.
"""

from __future__ import annotations

import collections
import functools
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Block, BlockTable, LayerRows, Tier
from tierkv.errors import BudgetTooSmallError, InvalidConfigError, TierKVError
from tierkv.layout import BlockLayout
from tierkv.policy import Policy
from tierkv.store.placement import Placement
from tierkv.store.plan import ReadPlan, build_plan, build_selection_plan
from tierkv.store.summaries import KeySummaries
from tierkv.store.transfer import ReadProbe, Transfer, link
from tierkv.store.writeback import Writeback
from tierkv.tiers.base import PendingRead, StorageTier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier

BACKFILL_COLUMNS = 64  # enable_summaries reads blocks already full in pieces of this many columns
PROMOTE_PER_LAYER = 2  # at most this many blocks move up to the device per layer-step of sparse attention


class Reader(Protocol):
    """Anything that reads from the store asynchronously (executors): the barrier waits for it."""

    def wait_all(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Split:
    """How ``tokens`` appended to rows of ``length`` tokens fall on blocks of ``block_tokens``: ``take`` of them
    into the partial tail column (which holds ``held``), the ``rest`` into ``new_columns`` new columns."""

    held: int
    take: int
    rest: int
    new_columns: int

    @classmethod
    def of(cls, length: int, tokens: int, block_tokens: int) -> _Split:
        held = length % block_tokens  # 0: there is no partial tail column
        take = min(block_tokens - held, tokens) if held else 0
        return cls(held, take, tokens - take, math.ceil((tokens - take) / block_tokens))


@dataclass(slots=True)
class _NewBlocks:
    """What one row takes in an append: tokens written in place into its open device tail, a copy of a
    shared or demoted tail (copy-on-write), then new blocks (the last one the new open tail)."""

    in_place: int = 0
    tail_copy: Block | None = None
    blocks: list[Block] = field(default_factory=list)


def _recovering(operation: Callable) -> Callable:
    """A store operation that, however it ends (an error, a KeyboardInterrupt at any line), leaves no slot
    taken that no block holds: :meth:`KVStore.recover` runs before the exception goes on. A second Ctrl-C that
    lands before ``recover`` holds interrupts leaves ``unrecovered`` set: the next operation recovers first."""

    @functools.wraps(operation)
    def run(self: KVStore, *args, **kwargs):
        if self.unrecovered:
            self.recover()
        try:
            return operation(self, *args, **kwargs)
        except BaseException:
            self.unrecovered = True  # by assignment, before any call: no signal is handled in between
            self.recover()
            raise

    return run


class KVStore:
    """Blocks of K/V for every (row, layer), spread over the device, host and disk tiers.

    Interrupts (docs/reliability.md): every operation first does what may fail or take time (allocation,
    copies, I/O), then commits its table edits inside :func:`~tierkv.atomic.deferred_interrupts`, so a Ctrl-C
    lands before the commit (the operation did not happen; :meth:`recover` gives back what it took) or after
    it (it did), never inside.
    """

    def __init__(self, device: MemoryTier, host: MemoryTier, disk: DiskTier | None, policy: Policy,
                 block_tokens: int) -> None:
        if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
            raise InvalidConfigError(f"block_tokens must be a positive int, got {block_tokens!r}.")
        self.tiers: dict[Tier, StorageTier] = {Tier.DEVICE: device, Tier.HOST: host}
        if disk is not None:
            self.tiers[Tier.DISK] = disk
        self.chain = tuple(self.tiers)
        self.policy = policy
        self.block_tokens = block_tokens
        self.table = BlockTable(block_tokens)
        self.layouts: dict[int, BlockLayout] = {}
        self.tick = 0
        self.unrecovered = False  # an operation failed and its recover() was cut short (see _recovering)
        self.device = device
        self.transfer = Transfer(self.tiers, device.device)
        self.writeback = Writeback(host, disk, lambda: self.table, policy, self.barrier, self._moved)
        self.placement = Placement(self.tiers, self.table, policy, self.transfer, self.writeback, self.layouts,
                                   self.barrier, self._moved)
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()  # their owner holds them: no cycle
        self._lengths: dict[int, int] = {}  # layer -> tokens per row (asked for several times per layer-step)
        self._plans: dict[int, tuple[int, dict[tuple[int, int], ReadPlan]]] = {}  # layer -> (version, plans)
        self._tails: dict[int, tuple[int, list[Block], list[torch.Tensor | None]]] = {}  # see _append_in_place
        self.summaries: KeySummaries | None = None  # per-block key summaries, once sparse attention asks for them
        self.promoted = 0  # blocks copied up to the device by promote()

    # ----------------------------------------------------------------------------------------- queries
    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.transfer.bytes_moved

    def seq_length(self, layer: int) -> int:
        return self._lengths.get(layer, 0)

    def check(self) -> None:
        """Raise ``AssertionError`` if the table's invariants, the kept lengths or the slot accounting are broken
        (for tests): every slot in use on a tier holds exactly one live block, or a write-back in flight."""
        self.table.check()
        held = collections.Counter((block.tier, block.slot_bytes) for block in self.table.blocks.values())
        places = {(block.tier, block.slot_bytes, block.slot) for block in self.table.blocks.values()}
        if len(places) != len(self.table.blocks):
            raise AssertionError("two live blocks share a slot")
        pending = self.writeback.pending
        if pending is not None:
            held[(Tier.DISK, pending.slot_bytes)] += len(pending.disk_slots)
        for kind, tier in self.tiers.items():
            for slot_bytes, used in tier.slot_counts().items():
                if used != held[(kind, slot_bytes)]:
                    raise AssertionError(f"{kind.label} tier: {used} slots of {slot_bytes} bytes in use, but "
                                         f"{held[(kind, slot_bytes)]} blocks hold them (a leaked slot)")
        for layer in self.table.rows:
            if self.table.seq_length(layer) != self.seq_length(layer):
                raise AssertionError(f"layer {layer}: kept length {self.seq_length(layer)} != "
                                     f"{self.table.seq_length(layer)} in the table")

    def recover(self) -> None:
        """After an operation that did not finish: forget blocks no row holds and give back every slot that no
        live block (or the write-back in flight) holds. O(blocks + slots), on the failure path only."""
        with deferred_interrupts():
            self.unrecovered = False
            listed = set()
            for rows in self.table.rows.values():
                listed.update(rows.ids.ravel().tolist())
            for block_id in [i for i in self.table.blocks if i not in listed]:  # allocated, never committed
                block = self.table.blocks.pop(block_id)
                self.policy.on_release(block)
                if self.summaries is not None:
                    self.summaries.release(block_id)
            held: dict[Tier, dict[int, set[int]]] = {kind: collections.defaultdict(set) for kind in self.tiers}
            for block in self.table.blocks.values():
                held[block.tier][block.slot_bytes].add(block.slot)
            pending = self.writeback.pending
            if pending is not None:
                held[Tier.DISK][pending.slot_bytes].update(pending.disk_slots)
            for kind, tier in self.tiers.items():
                tier.release_unheld(held[kind])

    def batch_size(self, layer: int) -> int:
        rows = self.table.layer_rows(layer)
        return rows.batch if rows is not None else 0

    def add_reader(self, reader: Reader) -> None:
        self._readers.add(reader)

    def barrier(self) -> None:
        """No read may be in flight while a slot is freed or moved."""
        for reader in list(self._readers):
            reader.wait_all()
        accel = self.transfer.accel
        if accel.streams:  # copies queued on the compute stream may still read host slots about to be reused:
            # the host tier's next CPU write waits for them, the CPU does not wait now (the GPU keeps its queue)
            event = accel.Event()
            event.record(accel.current_stream(self.device.device))
            self.tiers[Tier.HOST].fence_writes(event)

    # ----------------------------------------------------------------------------------------- append
    @_recovering
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, q, D]`` to every row of ``layer``. All or nothing."""
        layout = self._layout_for(layer, keys, values)
        batch, tokens = keys.shape[0], keys.shape[2]
        rows = self.table.layer_rows(layer)
        if rows is not None and rows.count and rows.batch == batch and self._append_in_place(layer, rows, keys, values):
            return
        if rows is None or rows.count == 0:
            rows = LayerRows(batch)
        elif rows.batch != batch:
            raise InvalidConfigError(
                f"layer {layer} holds {rows.batch} sequences but update() got a batch of {batch}; call "
                "cache.reset() before starting a new batch, or use reorder/select for beam search."
            )
        if layer == 0:
            self.tick += 1
        self.writeback.reap()
        kv = torch.stack((keys.detach(), values.detach()))  # [2, B, H_kv, q, D]; the cache holds no autograd graph
        length = self.seq_length(layer) if rows.count else 0
        split = _Split.of(length, tokens, self.block_tokens)
        allocated: list[Block] = []
        try:
            plans = self._allocate(layer, rows, split, layout, allocated)
            self._write(layer, layout, plans, kv, split)
            filled = self._filled_blocks(layer, plans, kv, split) if self.summaries is not None else None
        except BaseException:
            with deferred_interrupts():
                for block in allocated:
                    self.tiers[block.tier].free(block.slot_bytes, block.slot)
                    del self.table.blocks[block.id]
            raise
        if any(plan.tail_copy is not None for plan in plans):
            self.barrier()  # a replaced tail's slot is freed in the commit
        with deferred_interrupts():
            self._commit(layer, rows, plans, split)
            self._lengths[layer] = length + tokens
        if filled:
            self.summaries.add(layer, [block.id for block, _ in filled], torch.stack([kv for _, kv in filled]))
        self.writeback.maybe_start()

    def _append_in_place(self, layer: int, rows: LayerRows, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """The decode step's common case, kept short: the new tokens fit in every row's open tail, which is on
        the device and not shared — written where attention reads them, with no table change. False: use
        the general path. The tails and their slab views are looked up once per grid version (any edit that
        replaces or moves a tail changes it), not per token."""
        tails, views = self._open_tails(layer, rows)
        held, tokens = tails[0].tokens, keys.shape[2]
        if held + tokens > self.block_tokens or any(t.refcount != 1 or t.tier != Tier.DEVICE for t in tails):
            return False
        if layer == 0:
            self.tick += 1
        self.writeback.reap()
        if keys.requires_grad or values.requires_grad:  # the cache holds no autograd graph
            keys, values = keys.detach(), values.detach()
        if len(views) == 1:  # [2, H_kv, tokens, D] in one copy: cheaper than two strided ones (~4 vs ~18 us)
            views[0].narrow(2, held, tokens).copy_(torch.cat((keys, values)))
        else:
            kv = torch.stack((keys, values), dim=1)  # [B, 2, H_kv, tokens, D]
            for r, view in enumerate(views):  # view: the tail's slot as [2, H_kv, block_tokens, D]
                view.narrow(2, held, tokens).copy_(kv[r])
        length = self._lengths[layer]
        try:  # the commit, by assignment: an interrupt in it is undone (a deferred section costs ~10 us here)
            for tail in tails:
                tail.tokens = held + tokens
            self._lengths[layer] = length + tokens
        except BaseException:
            with deferred_interrupts():  # the undo is not cut by a second Ctrl-C
                for tail in tails:
                    tail.tokens = held
                self._lengths[layer] = length
            raise
        if self.summaries is not None and held + tokens == self.block_tokens:  # the tails just filled
            self.summaries.add(layer, [t.id for t in tails], torch.stack(views))
        self.writeback.maybe_start()
        return True

    def _open_tails(self, layer: int, rows: LayerRows) -> tuple[list[Block], list[torch.Tensor | None]]:
        """Each row's open tail block and its device slot as ``[2, H_kv, block_tokens, D]`` (None: not on the
        device), looked up once per grid version (any edit that replaces or moves a tail changes it)."""
        cached = self._tails.get(layer)
        if cached is None or cached[0] != rows.version:
            tails = [self.table.blocks[i] for i in rows.ids[:, -1].tolist()]
            layout = self.layouts[layer]
            views = [self.device.block(layout, t.slot) if t.tier == Tier.DEVICE else None for t in tails]
            cached = self._tails[layer] = (rows.version, tails, views)
        return cached[1], cached[2]

    def copy_open_tails(self, layer: int, dest: torch.Tensor, positions: np.ndarray) -> int:
        """Copy each row's open tail into block position ``positions[b]`` of ``dest``
        ``[2, B, H_kv, n · block_tokens, D]`` straight from its device slot: sparse attention's every-step read of
        the one block that changes, without planning a read. Counted as a device gather. Returns the bytes
        copied; 0 (nothing copied) where a tail is not on the device: read it with a plan."""
        rows = self.table.rows[layer]
        tails, views = self._open_tails(layer, rows)
        if any(view is None for view in views):
            return 0
        bt = self.block_tokens
        for row, (view, position) in enumerate(zip(views, positions.tolist())):
            dest[:, row, :, position * bt : (position + 1) * bt].copy_(view)  # the whole slot, like a planned read
        nbytes = len(views) * tails[0].tokens * self.layouts[layer].token_bytes
        self.transfer.count(link(Tier.DEVICE, Tier.DEVICE), nbytes)
        return nbytes

    def _layout_for(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> BlockLayout:
        known = self.layouts.get(layer)
        if known is not None and keys.shape == values.shape and keys.dim() == 4 and keys.dtype == known.dtype \
                and keys.shape[1] == known.kv_heads and keys.shape[3] == known.head_dim \
                and keys.device == self.device.device:
            return known  # the same geometry as before (checked without building a layout)
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

    def _allocate(self, layer: int, rows: LayerRows, split: _Split, layout: BlockLayout,
                  allocated: list[Block]) -> list[_NewBlocks]:
        """Allocate what each row needs for ``tokens`` more tokens.

        Each row's last new block becomes its open tail and must be on the device; those are allocated
        first, so the top-down placement of the other (full) new blocks cannot crowd them out.
        """
        held, take, new_columns = split.held, split.take, split.new_columns
        first_index = rows.front + rows.count
        plans = [_NewBlocks() for _ in range(rows.batch)]
        protect: set[int] = set()

        def device_block(index: int) -> Block:
            slot = self.placement.alloc_device(layout.slot_bytes, protect, (layer, index))
            block = self.table.new_block(layer, Tier.DEVICE, slot, layout.slot_bytes, index)
            allocated.append(block)
            protect.add(block.id)
            return block

        def placed_block(index: int) -> Block:
            tier, slot = self.placement.alloc_top_down(layout.slot_bytes, (layer, index))
            block = self.table.new_block(layer, tier, slot, layout.slot_bytes, index)
            allocated.append(block)
            return block

        copy_on_write = []
        for r, plan in enumerate(plans):
            if held:
                tail = self.table.tail(layer, r)
                if tail.refcount == 1 and tail.tier == Tier.DEVICE:
                    plan.in_place = take
                elif new_columns:  # shared or demoted tail that fills up: a full copy, placed like any full block
                    copy_on_write.append((plan, tail.index))
                else:  # ... that stays the open tail: its copy goes to the device
                    plan.tail_copy = device_block(tail.index)
            if new_columns:
                plan.blocks.append(device_block(first_index + new_columns - 1))
        for plan, index in copy_on_write:
            plan.tail_copy = placed_block(index)
        for plan in plans:
            plan.blocks[:0] = [placed_block(first_index + k) for k in range(new_columns - 1)]
        return plans

    def _write(self, layer: int, layout: BlockLayout, plans: list[_NewBlocks], kv: torch.Tensor,
               split: _Split) -> None:
        """Copy the appended tokens into their blocks: in place into open tails, whole (zero-padded) blocks
        elsewhere, one batched write per tier."""
        bt = self.block_tokens
        held, take = split.held, split.take
        by_tier: dict[Tier, tuple[list[int], list[torch.Tensor]]] = {}
        device: MemoryTier = self.device
        for r, plan in enumerate(plans):
            if plan.in_place:
                tail = self.table.tail(layer, r)
                device.block(layout, tail.slot)[:, :, held : held + take].copy_(kv[:, r, :, :take])
            if plan.tail_copy is not None:
                old = self.table.tail(layer, r)
                data = self.transfer.read_blocks(layout, old.tier, [old.slot])[0]
                data[:, :, held : held + take].copy_(kv[:, r, :, :take])
                data[:, :, held + take :].zero_()
                self.transfer.count(link(old.tier, Tier.DEVICE), held * layout.token_bytes)
                slots, datas = by_tier.setdefault(plan.tail_copy.tier, ([], []))
                slots.append(plan.tail_copy.slot)
                datas.append(data[None])
            if plan.blocks:
                rest = kv[:, r, :, take:]  # [2, H_kv, n, D]
                padded = torch.zeros((2, layout.kv_heads, len(plan.blocks) * bt, layout.head_dim),
                                     dtype=layout.dtype, device=kv.device)
                padded[:, :, : rest.shape[2]] = rest
                blocks = padded.unflatten(2, (len(plan.blocks), bt)).permute(2, 0, 1, 3, 4)  # [n, 2, H, bt, D]
                for block, data in zip(plan.blocks, blocks):
                    slots, datas = by_tier.setdefault(block.tier, ([], []))
                    slots.append(block.slot)
                    datas.append(data[None])
        for tier, (slots, datas) in by_tier.items():
            data = torch.cat(datas)
            self.transfer.write_blocks(layout, tier, slots, data)
            if tier != Tier.DEVICE:
                self.transfer.count(link(Tier.DEVICE, tier), len(slots) * bt * layout.token_bytes)

    def _filled_blocks(self, layer: int, plans: list[_NewBlocks], kv: torch.Tensor,
                       split: _Split) -> list[tuple[Block, torch.Tensor]]:
        """The blocks this append (written, not yet committed) fills, with their keys and values
        ``[2, H_kv, block_tokens, D]``: tails filled in place or by their copy, and every full new block (from
        ``kv``)."""
        bt, layout = self.block_tokens, self.layouts[layer]
        fills = split.held + split.take == bt and split.held > 0
        filled: list[tuple[Block, torch.Tensor]] = []
        for r, plan in enumerate(plans):
            if fills and plan.in_place:
                tail = self.table.tail(layer, r)
                filled.append((tail, self.device.block(layout, tail.slot)))
            elif fills and plan.tail_copy is not None:  # a shared or demoted tail, copied and filled (rare)
                copy = plan.tail_copy
                filled.append((copy, self.transfer.read_blocks(layout, copy.tier, [copy.slot])[0]))
            for k, block in enumerate(plan.blocks):
                if (k + 1) * bt <= split.rest:
                    filled.append((block, kv[:, r, :, split.take + k * bt : split.take + (k + 1) * bt]))
        return filled

    def _commit(self, layer: int, rows: LayerRows, plans: list[_NewBlocks], split: _Split) -> None:
        """The append's table edits (in memory only; run with interrupts deferred, after the barrier)."""
        bt = self.block_tokens
        held, take, rest = split.held, split.take, split.rest
        for r, plan in enumerate(plans):
            if plan.in_place:
                self.table.tail(layer, r).tokens += plan.in_place
            if plan.tail_copy is not None:
                old = self.table.tail(layer, r)
                plan.tail_copy.tokens = held + take
                rows.put(r, rows.count - 1, plan.tail_copy)
                self.policy.on_insert(plan.tail_copy, self.tick)
                released = self.table.release(old.id)
                if released is not None:
                    self._free(released, barrier=False)
        columns = len(plans[0].blocks) if plans else 0
        for k in range(columns):
            filled = min(bt, rest - k * bt)
            column = [plan.blocks[k] for plan in plans]
            for block in column:
                block.tokens = filled
                self.policy.on_insert(block, self.tick)
            rows.append_column(column)
        self.table.rows[layer] = rows

    # ----------------------------------------------------------------------------------------- reads
    def plan_read(self, layer: int, start: int, stop: int, access: bool = True) -> ReadPlan:
        """The plan that covers tokens ``[start, stop)`` of every row of ``layer`` in whole blocks: block
        columns ``[start // block_tokens, ceil(stop / block_tokens))``; records the access (one event for the
        layer) unless ``access`` is False (a plan looked at, not read)."""
        bt = self.block_tokens
        first, end = start // bt, -(-stop // bt)
        rows = self.table.layer_rows(layer)
        if access:
            self.policy.on_access(layer, self.tick)
        if rows is None or end <= first:
            return ReadPlan(layer, first, 0, ())
        version, plans = self._plans.get(layer, (-1, {}))
        if version != rows.version:
            plans = {}
            self._plans[layer] = (rows.version, plans)
        plan = plans.get((first, end))
        if plan is None:
            plan = plans[(first, end)] = build_plan(layer, rows, first, end, self.chain)
        return plan

    def plan_columns(self, layer: int, columns: np.ndarray) -> ReadPlan:
        """A plan for grid columns ``columns`` ``[B, K]`` (each row its own selection; -1: leave that position of
        the destination alone): sparse attention's read, one batched read per tier like any plan. Not cached
        (selections change every step)."""
        return build_selection_plan(layer, self.table.rows[layer], columns, self.chain)

    def enable_summaries(self, rest_bits: int = 0) -> KeySummaries:
        """Keep key summaries of full blocks from now on (:mod:`tierkv.store.summaries`), with a ``rest_bits``-bit
        copy of their keys and values if that is not 0, on the device and in its budget; blocks already full
        are summarised now, read once from wherever they live (again if ``rest_bits`` changed)."""
        if self.summaries is not None:
            if self.summaries.rest_bits == rest_bits:
                return self.summaries
            self.summaries.clear()
            self.summaries = None
        summaries = KeySummaries(self.device.device, self.reserve_device, self.device.unreserve, rest_bits)
        bt = self.block_tokens
        for layer, rows in self.table.rows.items():
            full = self.seq_length(layer) // bt
            layout = self.layouts[layer]
            for lo in range(0, full, BACKFILL_COLUMNS):
                hi = min(full, lo + BACKFILL_COLUMNS)
                plan = self.plan_read(layer, lo * bt, hi * bt, access=False)
                data = torch.empty((2, rows.batch, layout.kv_heads, (hi - lo) * bt, layout.head_dim),
                                   dtype=layout.dtype, device=self.device.device)
                self.read_into(layer, plan, data)
                blocks = data.unflatten(3, (hi - lo, bt)).permute(1, 3, 0, 2, 4, 5)  # [B, n, 2, H_kv, bt, D]
                summaries.add(layer, rows.ids[:, lo:hi].ravel().tolist(), blocks.flatten(0, 1))
        self.summaries = summaries
        return summaries

    def attended(self, layer: int, columns: np.ndarray, mass: np.ndarray | None) -> list[Block]:
        """Sparse attention read grid ``columns`` ``[B, K]`` of ``layer`` with softmax ``mass`` ``[B, K]`` (None:
        not measured): tell the policy (arrays: one event per layer-step), and return the off-device blocks it
        wants promoted (hottest first, at most ``PROMOTE_PER_LAYER``)."""
        rows = self.table.rows[layer]
        picked = (np.arange(rows.batch)[:, None], columns)
        ids = rows.ids[picked].ravel()
        weights = mass.ravel() if mass is not None else np.ones(ids.shape, dtype=np.float64)
        self.policy.on_attention(layer, self.tick, ids, weights)
        off = rows.tiers[picked].ravel() != Tier.DEVICE
        if not off.any():
            return []
        return [self.table.blocks[i] for i in self.policy.promotions(ids[off], PROMOTE_PER_LAYER)]

    def count_reused(self, layer: int, blocks: int) -> None:
        """Sparse attention copied ``blocks`` full blocks that it keeps on the device into its staging: counted
        as a device gather (``bytes_moved["device->device"]``), like the blocks it reads from the device tier."""
        nbytes = blocks * self.block_tokens * self.layouts[layer].token_bytes
        self.transfer.count(link(Tier.DEVICE, Tier.DEVICE), nbytes)

    def count_speculated(self, layer: int, blocks: int) -> None:
        """Sparse attention read ``blocks`` full disk blocks ahead of its selection (a speculation): counted in
        ``bytes_moved["disk->device"]`` when submitted, whether a selection uses them or not."""
        nbytes = blocks * self.block_tokens * self.layouts[layer].token_bytes
        self.transfer.count(link(Tier.DISK, Tier.DEVICE), nbytes)

    @_recovering
    def promote(self, blocks: list[Block], data: torch.Tensor, keep: np.ndarray) -> int:
        """Move ``blocks`` (off-device, one layer) up to the device, writing ``data`` ``[n, 2, H_kv, block_tokens,
        D]`` (their bytes, already staged on the device by the read that attended them: no second read) with one
        batched write. Each takes a free device slot, or the slot of one of the device's coldest blocks that the
        policy likes less (those move down in one demotion, nothing is dropped; never one of ``keep``, the ids
        just attended). Returns how many moved; a promotion is optional, so no room is not an error."""
        chosen = [i for i, b in enumerate(blocks) if b.tier != Tier.DEVICE and b.id not in self.writeback.pending_ids]
        if not chosen:
            return 0
        slot_bytes = blocks[chosen[0]].slot_bytes
        slots = self._device_slots(slot_bytes, len(chosen))
        if len(slots) < len(chosen):
            exclude = self.placement.open_tails() | set(keep.ravel().tolist()) | {blocks[i].id for i in chosen}
            victims = self.policy.victims(Tier.DEVICE, slot_bytes, len(chosen) - len(slots), exclude)
            hot = chosen[len(slots):]  # blocks come hottest first, victims coldest first
            pairs = [(i, v) for i, v in zip(hot, victims) if self.policy.prefers(blocks[i], v)]
            if pairs:
                try:
                    self.placement.demote([v for _, v in pairs])
                except TierKVError:  # no room below (a full disk): the cache is consistent, nothing moves up
                    pairs = []
                slots += self._device_slots(slot_bytes, len(pairs))
        chosen = chosen[: len(slots)]
        if not chosen:
            return 0
        layout = self.layouts[blocks[chosen[0]].layer]
        self.barrier()  # the old slots are freed below: no read of them may be in flight
        self.device.write_from(layout, np.asarray(slots, dtype=np.int64), data[chosen], self.transfer.scratch)
        with deferred_interrupts():  # table edits, at most PROMOTE_PER_LAYER (a failure above: recover frees slots)
            for i, slot in zip(chosen, slots):
                block = blocks[i]
                source = block.tier
                self.tiers[source].free(block.slot_bytes, block.slot)
                self.table.place(block, Tier.DEVICE, slot)
                self.policy.on_move(block, source)
            self.promoted += len(chosen)
        self.transfer.count(link(Tier.DEVICE, Tier.DEVICE), sum(blocks[i].tokens for i in chosen) * layout.token_bytes)
        return len(chosen)

    def _device_slots(self, slot_bytes: int, n: int) -> list[int]:
        """Up to ``n`` free device slots, allocated (fewer when the device is full)."""
        slots: list[int] = []
        while len(slots) < n:
            slot = self.device.alloc(slot_bytes)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def read_into(self, layer: int, plan: ReadPlan, dest: torch.Tensor, probe: ReadProbe | None = None,
                  ahead: PendingRead | None = None) -> None:
        """Copy ``plan``'s blocks into ``dest`` ``[2, B, H_kv, >= plan.blocks * block_tokens, D]`` (block
        column ``plan.first + i`` at tokens ``[i * block_tokens, (i + 1) * block_tokens)``); ``ahead`` is the
        plan's disk part from :meth:`read_ahead`."""
        if plan.parts:
            self.transfer.read_into(self.layouts[layer], plan, dest, self.table.tail(layer).tokens, probe, ahead)
        elif ahead is not None:
            ahead.settle()

    def read_ahead(self, layer: int, plan: ReadPlan, purpose: str) -> PendingRead | None:
        """Start reading ``plan``'s disk blocks now (the disk engine works on its own threads), into the scratch
        buffer ``purpose``; pass the result to :meth:`read_into` with the same plan. None: nothing on disk."""
        return self.transfer.read_ahead(self.layouts[layer], plan, purpose)

    def read_tokens(self, layer: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A fresh ``[2, B, H_kv, stop - start, D]`` copy of a token range (for tests and tools, not decode)."""
        stop = self.seq_length(layer) if stop is None else stop
        layout = self.layouts[layer]
        plan = self.plan_read(layer, start, stop)
        out = torch.empty((2, self.batch_size(layer), layout.kv_heads, plan.blocks * self.block_tokens,
                           layout.head_dim), dtype=layout.dtype, device=self.device.device)
        self.read_into(layer, plan, out)
        offset = start - plan.first * self.block_tokens
        return out[..., offset : offset + stop - start, :].clone()

    def export_blocks(self, layer: int, first: int, stop: int) -> torch.Tensor:
        """Blocks ``[first, stop)`` (sequence indices) of every row of ``layer`` as a fresh host tensor
        ``[B, n, 2, H_kv, block_tokens, D]``, one read per source tier — for persistence and saving, not the
        decode path (no access is recorded; a partial tail comes with its unused positions zeroed)."""
        rows = self.table.rows[layer]
        layout = self.layouts[layer]
        lo, hi = first - rows.front, stop - rows.front
        if not 0 <= lo <= hi <= rows.count:
            raise InvalidConfigError(f"blocks [{first}, {stop}) of layer {layer} are not held (it holds "
                                     f"[{rows.front}, {rows.front + rows.count})).")
        tiers, slots = rows.tiers[:, lo:hi], rows.slots[:, lo:hi]
        out = torch.empty((rows.batch, hi - lo, *layout.shape), dtype=layout.dtype)
        for tier in np.unique(tiers).tolist():
            where = tiers == tier
            into = Tier.DEVICE if tier == Tier.DEVICE else Tier.HOST  # the source's side, then to this host tensor
            out[torch.from_numpy(where)] = self.transfer.read_blocks(layout, Tier(tier), slots[where].tolist(),
                                                                     into=into).cpu()
        return out

    def enable_landing(self, nbytes: int) -> bool:
        """Reserve device landing buffers so host and disk runs cross the link as large copies.

        Worth it where a copy has a fixed cost and scattered destinations are slow to reach (CUDA: ~2 µs
        per copy, pageable or strided copies through hidden temporaries). False if the budget has no room.
        """
        if self.transfer.scratch.landing_bytes:
            return True
        try:
            self.reserve_device(2 * nbytes)  # one for the caller's thread, one for the mover's
        except BudgetTooSmallError:
            return False
        self.transfer.scratch.landing_bytes = nbytes
        return True

    @_recovering
    def reserve_device(self, nbytes: int) -> None:
        """Count ``nbytes`` of device staging against the device budget, evacuating blocks to make room."""
        self._forget_views()  # cached plans and tails hold views of slab chunks and staging that may go now
        self.placement.reserve_device(nbytes)

    def _forget_views(self) -> None:
        """Drop the cached plans (their memos keep index tensors and views of destinations) and tail views."""
        self._plans.clear()
        self._tails.clear()

    # ----------------------------------------------------------------------------------- table edits
    @_recovering
    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` of every layer becomes old row ``indices[i]`` (beam reorder, batch selection); every layer
        or none."""
        self.barrier()
        with deferred_interrupts():
            for layer in list(self.table.rows):
                for block in self.table.select_rows(layer, indices):
                    self._free(block, barrier=False)

    @_recovering
    def crop(self, layer: int, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` tokens of every row of ``layer``. All or nothing: the copy a cut
        through a shared block needs is made before any row changes."""
        length = self.seq_length(layer)
        remove = min(tokens_to_remove, length)
        if remove <= 0:
            return
        self.barrier()
        rows = self.table.rows[layer]
        bt = self.block_tokens
        keep_tokens = length - remove
        keep_columns = -(-keep_tokens // bt)
        in_last = keep_tokens - (keep_columns - 1) * bt if keep_columns else 0
        copies: dict[int, Block] = {}
        if keep_columns and in_last < self.table.blocks[int(rows.ids[0, keep_columns - 1])].tokens:
            allocated: list[Block] = []
            try:
                for r in range(rows.batch):
                    cut = self.table.blocks[int(rows.ids[r, keep_columns - 1])]
                    if cut.refcount > 1:
                        copies[r] = self._copy_prefix(cut, in_last, allocated)
            except BaseException:
                with deferred_interrupts():
                    for block in allocated:
                        self.policy.on_release(block)
                        self.tiers[block.tier].free(block.slot_bytes, block.slot)
                        del self.table.blocks[block.id]
                raise
        with deferred_interrupts():
            self._cut(layer, rows, keep_columns, keep_tokens, in_last, copies)

    def _cut(self, layer: int, rows: LayerRows, keep_columns: int, keep_tokens: int, in_last: int,
             copies: dict[int, Block]) -> None:
        """The crop's table edits (in memory only; run with interrupts deferred, after the barrier)."""
        layout = self.layouts[layer]
        for block_id in rows.ids[:, keep_columns:].ravel().tolist():
            released = self.table.release(block_id)
            if released is not None:
                self._free(released, barrier=False)
        rows.truncate(keep_columns)
        self._lengths[layer] = keep_tokens
        if not keep_columns:
            return
        for r in range(rows.batch):
            if r in copies:
                released = self.table.release(int(rows.ids[r, keep_columns - 1]))
                if released is not None:  # every row that shared it took a copy
                    self._free(released, barrier=False)
                rows.put(r, keep_columns - 1, copies[r])
            else:
                cut = self.table.blocks[int(rows.ids[r, keep_columns - 1])]
                if cut.tokens > in_last:
                    cut.tokens = in_last
                    if cut.tier == Tier.DEVICE:  # no stale bytes past the tokens (a demoted cut is copied on write)
                        self.device.block(layout, cut.slot)[:, :, in_last:].zero_()

    @_recovering
    def drop_front(self, layer: int, whole_blocks_before: int) -> int:
        """Free whole blocks that end before token ``whole_blocks_before``; return the tokens dropped."""
        rows = self.table.layer_rows(layer)
        if rows is None or rows.count < 2:
            return 0
        columns = min(whole_blocks_before // self.block_tokens, rows.count - 1)
        if columns <= 0:
            return 0
        self.barrier()
        with deferred_interrupts():
            for block_id in rows.ids[:, :columns].ravel().tolist():
                released = self.table.release(block_id)
                if released is not None:
                    self._free(released, barrier=False)
            rows.drop_front(columns)
            self._lengths[layer] -= columns * self.block_tokens
        return columns * self.block_tokens

    def _copy_prefix(self, block: Block, keep: int, allocated: list[Block]) -> Block:
        """A new device block holding the first ``keep`` tokens of ``block`` (copy-on-write of a cut)."""
        layout = self.layouts[block.layer]
        data = self.transfer.read_blocks(layout, block.tier, [block.slot])
        data[0, :, :, keep:].zero_()
        slot = self.placement.alloc_device(layout.slot_bytes, {b.id for b in allocated} | {block.id},
                                           (block.layer, block.index))
        copy = self.table.new_block(block.layer, Tier.DEVICE, slot, layout.slot_bytes, block.index)
        allocated.append(copy)
        self.transfer.write_blocks(layout, Tier.DEVICE, [slot], data)
        self.transfer.count(link(block.tier, Tier.DEVICE), keep * layout.token_bytes)
        copy.tokens = keep
        self.policy.on_insert(copy, self.tick)
        return copy

    def _free(self, block: Block, barrier: bool = True) -> None:
        if barrier:
            self.barrier()
        self.policy.on_release(block)
        if self.summaries is not None:
            self.summaries.release(block.id)
        self.tiers[block.tier].free(block.slot_bytes, block.slot)

    def _moved(self, block: Block, source: Tier, target: Tier) -> None:
        self.transfer.count(link(source, target), block.tokens * self.layouts[block.layer].token_bytes)

    # ------------------------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget every block; pools stay allocated for the next sequence. Every slot is free afterwards, also one
        that an interrupted operation (a KeyboardInterrupt mid-append) left taken."""
        self.barrier()
        self.writeback.reap(wait=True)
        with deferred_interrupts():
            self.writeback.resume()
            for block in list(self.table.blocks.values()):
                self.policy.on_release(block)
            for tier in self.tiers.values():
                tier.free_all()
            if self.summaries is not None:
                self.summaries.clear()
            self.table.clear()
            self._forget_views()
            self._lengths.clear()
            self.layouts.clear()  # the next sequence may come from another model or dtype

    def close(self) -> None:
        """Release every tier (idempotent); the tiers are closed even if waiting for reads failed."""
        try:
            self.barrier()
            self.writeback.reap(wait=True)
        finally:
            for block in list(self.table.blocks.values()):
                self.policy.on_release(block)
            if self.summaries is not None:
                self.summaries.clear()
            self.table.clear()
            self._forget_views()
            self._lengths.clear()
            try:
                for tier in self.tiers.values():
                    tier.close()
            finally:
                self.transfer.scratch.release()

    def stats(self) -> dict:
        counts, resident = self.table.residency({layer: layout.token_bytes for layer, layout in self.layouts.items()})
        return {
            "bytes_resident": {tier.label: resident[tier] for tier in Tier},
            "bytes_allocated": {tier.label: self.tiers[tier].allocated_bytes for tier in self.tiers},
            "peak_bytes_allocated": {tier.label: self.tiers[tier].peak_bytes for tier in self.tiers},
            "budget_bytes": {tier.label: self.tiers[tier].budget for tier in self.tiers},
            "bytes_staging": self.device.reserved,
            "bytes_summaries": self.summaries.nbytes if self.summaries is not None else 0,
            "blocks_promoted": self.promoted,
            "bytes_moved": dict(self.bytes_moved),
            "writeback": {"pending_blocks": len(self.writeback.pending_ids), "paused": self.writeback.paused_reason},
            "blocks": {tier.label: counts[tier] for tier in Tier},
        }

    # ------------------------------------------------------------------------------ for tests/tools
    @_recovering
    def demote(self, blocks: list[Block]) -> None:
        """Move ``blocks`` one step down the chain now (tests and tools; decoding demotes on its own). Blocks
        already on the lowest tier stay where they are; the others move per (tier, slot size) group."""
        groups: dict[tuple[Tier, int], list[Block]] = {}
        for block in blocks:
            if block.tier != self.chain[-1]:
                groups.setdefault((block.tier, block.slot_bytes), []).append(block)
        for (tier, _), group in sorted(groups.items(), key=lambda item: -item[0][0]):  # lowest tier first:
            still = [block for block in group if block.tier == tier]  # a cascade only pushes lower blocks down
            if still:
                self.placement.demote(still)
