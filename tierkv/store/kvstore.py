"""The KV block store: the block table, the tier chain and the policy, kept consistent together.

It knows nothing about transformers. Its callers append K/V per layer, plan reads of token ranges and
execute them into a destination tensor; it decides where every block lives (:mod:`.placement`), and moves
the bytes (:mod:`.transfer`).

Every change is transactional: an append that fails (disk full, budget exhausted) leaves the table as it
was, and every token accepted before it still reads back. Table edits that free or move slots first wait
for in-flight reads: executors register as *readers* (:meth:`KVStore.add_reader`) and the store's
:meth:`~KVStore.barrier` waits for them.

Executors' device buffers count against the device budget like blocks: :meth:`KVStore.reserve_device` (which
demotes blocks to make room), then :meth:`KVStore.release_device` (the buffers come from ``tierkv.staging``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np
import torch

from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Block, BlockTable, LayerRows, Tier
from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.layout import BlockLayout
from tierkv.policy import Policy
from tierkv.staging import device_minimum, open_tail_bytes
from tierkv.store import consistency, edits, export
from tierkv.store import pages as page_reads
from tierkv.store.placement import BlockPlacement
from tierkv.store.plan import ReadPlan, build_plan, build_selection_plan
from tierkv.store.summaries import KeySummaries
from tierkv.store.transfer import PartTiming, Transfer, link
from tierkv.store.writeback import Writeback
from tierkv.tiers.base import PendingRead, StorageTier
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier


class Reader(Protocol):
    """Anything that reads from the store asynchronously (executors): the barrier waits for it."""

    def wait_all(self) -> None: ...


def recovering(operation: Callable) -> Callable:
    """A store operation that, however it ends (an error, a KeyboardInterrupt at any line), leaves no slot
    taken that no block holds: :meth:`KVStore.recover` runs before the exception goes on. A second Ctrl-C that
    lands before ``recover`` holds interrupts leaves ``unrecovered`` set: the next operation recovers first.
    For methods of the store, or of a service built over one (its ``store`` attribute)."""

    @functools.wraps(operation)
    def run(owner: KVStore | Any, *args, **kwargs):
        store = owner if isinstance(owner, KVStore) else owner.store
        if store.unrecovered:
            store.recover()
        try:
            return operation(owner, *args, **kwargs)
        except BaseException:
            store.unrecovered = True  # by assignment, before any call: no signal is handled in between
            store.recover()
            raise

    return run


def _same_geometry(layout: BlockLayout, keys: torch.Tensor, values: torch.Tensor, device: torch.device) -> bool:
    """Whether new ``keys``/``values`` fit the layer's ``layout`` (the decode step's check, no layout built)."""
    return keys.shape == values.shape and keys.dim() == 4 and keys.dtype == layout.dtype \
        and keys.shape[1] == layout.kv_heads and keys.shape[3] == layout.head_dim and keys.device == device


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
        self.unrecovered = False  # an operation failed and its recover() was cut short (see recovering)
        self.device, self.host = device, host
        self.transfer = Transfer(self.tiers, device.device)
        self.writeback = Writeback(host, disk, lambda: self.table, policy, self.barrier, self._moved)
        self.placement = BlockPlacement(self.tiers, self.table, policy, self.transfer, self.writeback, self.barrier,
                                   self._moved)
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()  # their owner holds them: no cycle
        self.lengths: dict[int, int] = {}  # layer -> tokens per row (asked for several times per layer-step)
        self._plans: dict[int, tuple[int, dict[tuple[int, int], ReadPlan]]] = {}  # layer -> (version, plans)
        self._tails: dict[int, tuple[int, list[Block], list[torch.Tensor | None]]] = {}  # see tail_views
        # per-block key summaries, kept with the blocks once sparse attention asks for them
        # (tierkv.attention.sparse_store): added as blocks fill, released with them
        self.summaries: KeySummaries | None = None

    # ----------------------------------------------------------------------------------------- queries
    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.transfer.bytes_moved

    def seq_length(self, layer: int) -> int:
        return self.lengths.get(layer, 0)

    def check(self) -> None:
        """Raise ``AssertionError`` if the table's invariants, the kept lengths or the slot accounting are broken
        (for tests): every slot in use on a tier holds exactly one live block, or a write-back in flight."""
        consistency.check(self)

    def recover(self) -> None:
        """After an operation that did not finish: forget blocks no row holds and give back every slot that no
        live block (or the write-back in flight) holds. O(blocks + slots), on the failure path only."""
        consistency.recover(self)

    def batch_size(self, layer: int) -> int:
        rows = self.table.rows.get(layer)
        return rows.batch if rows is not None else 0

    def add_reader(self, reader: Reader) -> None:
        self._readers.add(reader)

    def barrier(self) -> None:
        """No read may be in flight while a slot is freed or moved."""
        for reader in list(self._readers):
            reader.wait_all()
        accel: Any = self.transfer.accel
        if accel.streams:  # copies queued on the compute stream may still read host slots about to be reused:
            # the host tier's next CPU write waits for them, the CPU does not wait now (the GPU keeps its queue)
            event = accel.Event()
            event.record(accel.current_stream(self.device.device))
            self.host.fence_writes(event)

    # ----------------------------------------------------------------------------------------- append
    @recovering
    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor, first_block: int = 0,
               summarise_from: int = 0) -> None:
        """Append ``keys``/``values`` ``[B, H_kv, q, D]`` to every row of ``layer``. All or nothing.
        ``first_block``: where a new layer's first block sits in its sequence (a loaded sliding layer whose window
        had dropped the blocks before it); a layer emptied by a crop keeps its own. ``summarise_from``: blocks this
        append fills that end at or before this token of the layer get no key summary (a sliding window drops them
        before they are attended again); the layer's summaries are completed when sparse attention next asks."""
        layout = self.layouts.get(layer)
        if layout is None or not _same_geometry(layout, keys, values, self.device.device):
            layout = edits.layout_for(self, layer, keys, values)  # a new layer, or an error that says what changed
        batch, tokens = keys.shape[0], keys.shape[2]
        rows = self.table.rows.get(layer)
        if rows is not None and rows.count and rows.batch == batch and self._append_in_place(layer, rows, keys, values):
            return
        if rows is None or rows.count == 0:
            front = rows.front if rows is not None else first_block
            rows = LayerRows(batch)
            rows.front = front
        elif rows.batch != batch:
            repeat = (f"; to run beams or num_return_sequences={batch // rows.batch} over the tokens it holds (a "
                      f"loaded prefix, an earlier turn), repeat its rows first: cache.batch_repeat_interleave("
                      f"{batch // rows.batch})") if batch % rows.batch == 0 else ""
            raise InvalidConfigError(
                f"layer {layer} holds {rows.batch} sequences but update() got a batch of {batch}; call "
                f"cache.reset() before starting a new batch, or use reorder/select for beam search{repeat}."
            )
        if layer == 0:
            self.tick += 1
        self.writeback.reap()
        kv = torch.stack((keys.detach(), values.detach()))  # [2, B, H_kv, q, D]; the cache holds no autograd graph
        length = self.seq_length(layer) if rows.count else 0
        split = edits.Split.of(length, tokens, self.block_tokens)
        allocated: list[Block] = []
        try:
            plans = edits.allocate(self, layer, rows, split, layout, allocated)
            edits.write(self, layer, layout, plans, kv, split)
            filled = edits.filled_blocks(self, layer, plans, kv, split, length, summarise_from) \
                if self.summaries is not None else None
        except BaseException:
            with deferred_interrupts():
                for block in allocated:
                    self.tiers[block.tier].free(block.slot_bytes, block.slot)
                    del self.table.blocks[block.id]
            raise
        if any(plan.tail_copy is not None for plan in plans):
            self.barrier()  # a replaced tail's slot is freed in the commit
        with deferred_interrupts():
            edits.commit(self, layer, rows, plans, split)
            self.lengths[layer] = length + tokens
        if self.summaries is not None:
            if summarise_from > length:  # blocks may have gone unsummarised: the next enable_summaries checks
                self.summaries.backfilled.discard(layer)
            if filled:
                self.summaries.add(layer, [block.id for block, _ in filled], torch.stack([kv for _, kv in filled]))
        self.writeback.maybe_start()

    def _append_in_place(self, layer: int, rows: LayerRows, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """The decode step's common case, kept short: the new tokens fit in every row's open tail, which is on
        the device and not shared — written where attention reads them, with no table change. False: use
        the general path. The tails and their slab views are looked up once per grid version (any edit that
        replaces or moves a tail changes it), not per token."""
        tails, maybe_views = self.tail_views(layer)
        held, tokens = tails[0].tokens, keys.shape[2]
        if held + tokens > self.block_tokens or any(t.refcount != 1 or t.tier != Tier.DEVICE for t in tails):
            return False
        views = cast(list[torch.Tensor], maybe_views)  # every tail is on the device
        if layer == 0:
            self.tick += 1
        if keys.requires_grad or values.requires_grad:  # the cache holds no autograd graph
            keys, values = keys.detach(), values.detach()
        if len(views) == 1:  # [2, H_kv, tokens, D] in one copy: cheaper than two strided ones (~4 vs ~18 us)
            views[0].narrow(2, held, tokens).copy_(torch.cat((keys, values)))
        else:
            kv = torch.stack((keys, values), dim=1)  # [B, 2, H_kv, tokens, D]
            for r, view in enumerate(views):  # view: the tail's slot as [2, H_kv, block_tokens, D]
                view.narrow(2, held, tokens).copy_(kv[r])
        length = self.lengths[layer]
        try:  # the commit, by assignment: an interrupt in it is undone (a deferred section costs ~10 us here)
            for tail in tails:
                tail.tokens = held + tokens
            self.lengths[layer] = length + tokens
        except BaseException:
            with deferred_interrupts():  # the undo is not cut by a second Ctrl-C
                for tail in tails:
                    tail.tokens = held
                self.lengths[layer] = length
            raise
        if self.summaries is not None and held + tokens == self.block_tokens:  # the tails just filled
            self.summaries.add(layer, [t.id for t in tails], torch.stack(views))
        writeback = self.writeback
        if writeback.enabled or writeback.pending is not None:  # else there is nothing to reap or start
            writeback.maybe_start()  # reaps first; nothing was allocated here, so reaping after the write is as good
        return True

    def tail_views(self, layer: int) -> tuple[list[Block], list[torch.Tensor | None]]:
        """Each row's last block of ``layer`` and its device slot as ``[2, H_kv, block_tokens, D]`` (None: not on
        the device), looked up once per grid version (any edit that replaces or moves a tail changes it)."""
        rows = self.table.rows[layer]
        cached = self._tails.get(layer)
        if cached is None or cached[0] != rows.version:
            tails = [self.table.blocks[i] for i in rows.ids[:, -1].tolist()]
            layout = self.layouts[layer]
            views = [self.device.block(layout, t.slot) if t.tier == Tier.DEVICE else None for t in tails]
            cached = self._tails[layer] = (rows.version, tails, views)
        return cached[1], cached[2]

    # ----------------------------------------------------------------------------------------- reads
    def plan_read(self, layer: int, start: int, stop: int, access: bool = True) -> ReadPlan:
        """The plan that covers tokens ``[start, stop)`` of every row of ``layer`` in whole blocks: block
        columns ``[start // block_tokens, ceil(stop / block_tokens))``; records the access (one event for the
        layer) unless ``access`` is False (a plan looked at, not read)."""
        bt = self.block_tokens
        first, end = start // bt, -(-stop // bt)
        rows = self.table.rows.get(layer)
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

    def read_pages(self, layer: int, columns: np.ndarray, pages: np.ndarray, page_tokens: int,
                   dest: torch.Tensor) -> None:
        """Copy page ``pages[b, k]`` of full grid column ``columns[b, k]`` (-1: none) of row ``b`` into ``dest[:, b,
        :, k * page_tokens : (k + 1) * page_tokens]``: reads finer than a block (:func:`.pages.read_pages`)."""
        page_reads.read_pages(self, layer, columns, pages, page_tokens, dest)

    def start_read_pages(self, layer: int, columns: np.ndarray, pages: np.ndarray, page_tokens: int,
                         dest: torch.Tensor) -> page_reads.PageRead:
        """:meth:`read_pages` with the disk's part left in flight until the returned read's ``finish()``
        (:func:`.pages.start_read_pages`)."""
        return page_reads.start_read_pages(self, layer, columns, pages, page_tokens, dest)

    def read_into(self, layer: int, plan: ReadPlan, dest: torch.Tensor, timings: list[PartTiming] | None = None,
                  ahead: PendingRead | None = None) -> None:
        """Copy ``plan``'s blocks into ``dest`` ``[2, B, H_kv, >= plan.blocks * block_tokens, D]`` (block
        column ``plan.first + i`` at tokens ``[i * block_tokens, (i + 1) * block_tokens)``); ``ahead`` is the
        plan's disk part from :meth:`read_ahead`; ``timings`` (telemetry) gets one record per source tier."""
        if plan.parts:
            tail = self.table.blocks[int(self.table.rows[layer].ids[0, -1])]
            self.transfer.read_into(self.layouts[layer], plan, dest, tail.tokens, timings, ahead)
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
        """Blocks ``[first, stop)`` of every row of ``layer`` as a host tensor (:func:`.export.export_blocks`)."""
        return export.export_blocks(self, layer, first, stop)

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

    def room_for_staging(self, nbytes: int, batch: int, layers: int | None = None) -> bool:
        """Whether ``nbytes`` more device staging fit the device budget beside one open block per row of every
        layer (``layers``; default: the layers seen), each as wide as the widest (:func:`device_minimum`)."""
        slot = max((layout.slot_bytes for layout in self.layouts.values()), default=0)
        tails = open_tail_bytes(layers or len(self.layouts), batch, slot)
        return device_minimum(self.device.reserved + nbytes, tails) <= self.device.budget

    @recovering
    def reserve_device(self, nbytes: int) -> None:
        """Count ``nbytes`` of device staging (an executor's buffers) against the device budget, demoting blocks
        to make room; raises :class:`~tierkv.errors.BudgetTooSmallError` with the numbers when it cannot.
        Give the bytes back with :meth:`release_device`."""
        self._forget_views()  # cached plans and tails hold views of slab chunks and staging that may go now
        self.placement.reserve_device(nbytes)

    def release_device(self, nbytes: int) -> None:
        """Give back ``nbytes`` reserved with :meth:`reserve_device`, once the caller dropped its buffers: the
        freed memory goes back to the driver too (an accelerator's caching allocator would keep it)."""
        if nbytes:
            self.device.unreserve(nbytes)
            self.device.accel.release_cached()

    def _forget_views(self) -> None:
        """Drop the cached plans (their memos keep index tensors and views of destinations) and tail views."""
        self._plans.clear()
        self._tails.clear()

    # ----------------------------------------------------------------------------------- table edits
    @recovering
    def select_rows(self, indices: list[int]) -> None:
        """Row ``i`` of every layer becomes old row ``indices[i]`` (beam reorder, batch selection); every layer
        or none."""
        self.barrier()
        with deferred_interrupts():
            for layer in list(self.table.rows):
                for block in self.table.select_rows(layer, indices):
                    self.free_block(block, barrier=False)

    @recovering
    def crop(self, layer: int, tokens_to_remove: int) -> None:
        """Drop the last ``tokens_to_remove`` tokens of every row of ``layer``. Reads and allocates nothing (a block
        the rows share is cut where it is and stays shared: the next append copies it on write), so a crop cannot
        fail part-way, nor a cache's crop between its layers."""
        length = self.seq_length(layer)
        remove = min(tokens_to_remove, length)
        if remove <= 0:
            return
        self.barrier()
        with deferred_interrupts():
            edits.cut(self, layer, length - remove)

    @recovering
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
                    self.free_block(released, barrier=False)
            rows.drop_front(columns)
            self.lengths[layer] -= columns * self.block_tokens
        return columns * self.block_tokens

    def free_block(self, block: Block, barrier: bool = True) -> None:
        """Give a released block's slot back (after the barrier, unless the caller ran it) and forget it."""
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
            self._forget_blocks()
            for tier in self.tiers.values():
                tier.free_all()
            self.layouts.clear()  # the next sequence may come from another model or dtype

    def close(self) -> None:
        """Release every tier (idempotent); the tiers are closed even if waiting for reads failed."""
        try:
            self.barrier()
            self.writeback.reap(wait=True)
        finally:
            self._forget_blocks()
            try:
                for tier in self.tiers.values():
                    tier.close()
            finally:
                self.transfer.scratch.release()

    def drop_summaries(self) -> None:
        """Give the key summaries' (and rest copy's) device bytes back and stop summarising blocks as they fill,
        until sparse attention asks again (:meth:`SparseBlocks.enable_summaries` rebuilds them)."""
        if self.summaries is not None:
            self.summaries.clear()
            self.summaries = None

    def _forget_blocks(self) -> None:
        """Empty the table, and everything kept per block (the policy's index, summaries, cached plans)."""
        for block in list(self.table.blocks.values()):
            self.policy.on_release(block)
        self.drop_summaries()
        self.table.clear()
        self._forget_views()
        self.lengths.clear()

    def stats(self) -> dict:
        counts, resident = self.table.residency({layer: layout.token_bytes for layer, layout in self.layouts.items()})
        return {
            "bytes_resident": {tier.label: resident[tier] for tier in Tier},
            "bytes_allocated": {tier.label: self.tiers[tier].allocated_bytes for tier in self.tiers},
            "peak_bytes_allocated": {tier.label: self.tiers[tier].peak_bytes for tier in self.tiers},
            "budget_bytes": {tier.label: self.tiers[tier].budget for tier in self.tiers},
            "bytes_staging": self.device.reserved,
            "bytes_summaries": self.summaries.nbytes if self.summaries is not None else 0,
            "blocks_promoted": self.placement.promoted,
            "bytes_moved": dict(self.bytes_moved),
            "writeback": {"pending_blocks": len(self.writeback.pending_ids), "paused": self.writeback.paused_reason},
            "blocks": {tier.label: counts[tier] for tier in Tier},
        }

    # ------------------------------------------------------------------------------ for tests/tools
    @recovering
    def demote(self, blocks: list[Block]) -> None:
        """Move ``blocks`` one step down the chain now (tests and tools; decoding demotes on its own). Blocks
        already on the lowest tier stay where they are; the others move per (tier, slot size) group."""
        self.placement.demote_any(blocks)
