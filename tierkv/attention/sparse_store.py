"""The store services only sparse attention uses, built over a :class:`~tierkv.store.KVStore`.

Sparse attention reads a different selection of blocks every step, so besides the store's table and reads it
needs: key summaries of full blocks to rank them by (:meth:`SparseBlocks.enable_summaries`), the open tails
copied straight from their device slots (the one block every step reads, without a plan), the policy told
what was attended and with how much mass, hot blocks promoted to the device, and byte counts for the blocks it
reuses or reads ahead. Exact executors need none of it, so none of it is in the store.

:class:`SparseBlocks` holds nothing of its own: what must outlive an executor lives in the store (its
``summaries``, kept consistent with the blocks by every append and free; promotions counted by placement), so
any number of them may be built over one store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import torch

from tierkv.blocks import Block, Tier
from tierkv.errors import TierKVError
from tierkv.store import KVStore, ReadPlan
from tierkv.store.kvstore import recovering
from tierkv.store.summaries import KeySummaries
from tierkv.store.transfer import link

BACKFILL_COLUMNS = 64  # enable_summaries reads blocks already full in pieces of this many columns
PROMOTE_PER_LAYER = 2  # at most this many blocks move up to the device per layer-step of sparse attention
BlockRead = Callable[[int, ReadPlan, torch.Tensor], None]
"""Reads a plan's blocks of a layer into a tensor (:meth:`KVStore.read_into`'s first three arguments)."""
_DEVICE = int(Tier.DEVICE)  # an int: numpy compares it without ~6 Python calls of enum lookups


class SparseBlocks:
    """Sparse attention's view of a store: summaries, open-tail copies, attention events, promotion, counts."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def enable_summaries(self, rest_bits: int = 0, page_tokens: int | None = None, layer: int | None = None,
                         read: BlockRead | None = None) -> KeySummaries:
        """Keep key summaries of every ``page_tokens``-token page of full blocks from now on (None: one per block;
        :mod:`tierkv.store.summaries`), with a ``rest_bits``-bit copy of their keys and values if that is not 0,
        on the device and in its budget (rebuilt if ``rest_bits`` or ``page_tokens`` changed). Blocks already full
        are summarised when their layer first needs them — ``layer``'s now (every layer's where None) — read once
        from wherever they live: a sliding-window layer drops the blocks that left its window at its own next
        update, so summarising every layer when the first one attends would size the others' tables for the whole
        prompt. A refused reservation gives back every byte the summaries held (they are rebuilt when next asked).
        ``read(layer, plan, dest)`` reads those blocks (default: the store's ``read_into``; an executor passes its
        own to time them in its step)."""
        store = self.store
        summaries = store.summaries
        if summaries is not None and (summaries.rest_bits, summaries.page_tokens) != (rest_bits, page_tokens):
            store.drop_summaries()
            summaries = None
        if summaries is None:
            summaries = KeySummaries(store.device.device, store.reserve_device, store.release_device, rest_bits,
                                     page_tokens)
            summaries.pages(store.block_tokens)  # a page size that does not divide the blocks: refused before reads
            store.summaries = summaries  # blocks that fill from now on are summarised as they fill
        for index in list(store.table.rows) if layer is None else [layer]:
            if index in summaries.backfilled or index not in store.table.rows:
                continue
            try:
                self._backfill(summaries, index, read or store.read_into)
            except BaseException:
                store.drop_summaries()
                raise
            summaries.backfilled.add(index)
        return summaries

    def _backfill(self, summaries: KeySummaries, layer: int, read: BlockRead) -> None:
        """Summarise ``layer``'s full blocks that have no summary yet, read in pieces of whole block columns
        through device memory counted in the budget: the layer's table grown for them first, then as many columns
        as the budget has free room left for (up to :data:`BACKFILL_COLUMNS`), at least one
        (``min_sparse_device_bytes`` counts one; it may move a block)."""
        store = self.store
        bt = store.block_tokens
        rows = store.table.rows[layer]
        full = store.seq_length(layer) // bt
        layout = store.layouts[layer]
        missing = summaries.rows(rows.ids[:, :full]) < 0  # [B, full]
        if not missing.any():
            return
        summaries.make_room(layer, int(np.unique(rows.ids[:, :full][missing]).size), layout.kv_heads,
                            layout.head_dim, layout.dtype, bt)  # the table first: the pieces take what is left
        column = rows.batch * layout.slot_bytes
        device = store.device
        step = int(min(BACKFILL_COLUMNS, full, max(1, device.unallocated_bytes // column)))
        store.reserve_device(step * column)
        try:
            for lo in range(0, full, step):
                hi = min(full, lo + step)
                if not missing[:, lo:hi].any():
                    continue
                plan = store.plan_read(layer, lo * bt, hi * bt, access=False)
                shape = (2, rows.batch, layout.kv_heads, (hi - lo) * bt, layout.head_dim)
                data = store.transfer.accel.empty_blocks(shape, layout.dtype, device.device)
                read(layer, plan, data)
                blocks = data.unflatten(3, (hi - lo, bt)).permute(1, 3, 0, 2, 4, 5)  # [B, n, 2, H_kv, bt, D]
                summaries.add(layer, rows.ids[:, lo:hi].ravel().tolist(), blocks.flatten(0, 1))
                del data, blocks
        finally:
            store.release_device(step * column)

    def copy_open_tails(self, layer: int, dest: torch.Tensor, positions: np.ndarray) -> int:
        """Copy each row's open tail into block position ``positions[b]`` of ``dest``
        ``[2, B, H_kv, n · block_tokens, D]`` straight from its device slot: sparse attention's every-step read of
        the one block that changes, without planning a read. Counted as a device gather. Returns the bytes
        copied; 0 (nothing copied) where a tail is not on the device: read it with a plan."""
        store = self.store
        tails, maybe_views = store.tail_views(layer)
        if any(view is None for view in maybe_views):
            return 0
        views = cast(list[torch.Tensor], maybe_views)
        bt = store.block_tokens
        for row, (view, position) in enumerate(zip(views, positions.tolist())):
            dest[:, row, :, position * bt : (position + 1) * bt].copy_(view)  # the whole slot, like a planned read
        nbytes = len(views) * tails[0].tokens * store.layouts[layer].token_bytes
        store.transfer.count(link(Tier.DEVICE, Tier.DEVICE), nbytes)
        return nbytes

    def attended(self, layer: int, columns: np.ndarray, mass: np.ndarray | None) -> list[Block]:
        """Sparse attention read grid ``columns`` ``[B, K]`` of ``layer`` with softmax ``mass`` ``[B, K]`` (None:
        not measured): tell the policy (arrays: one event per layer-step), and return the off-device blocks it
        wants promoted (hottest first, at most ``PROMOTE_PER_LAYER``)."""
        store = self.store
        rows = store.table.rows[layer]
        picked = (np.arange(rows.batch)[:, None], columns)
        ids = rows.ids[picked].ravel()
        weights = mass.ravel() if mass is not None else np.ones(ids.shape, dtype=np.float64)
        store.policy.on_attention(layer, store.tick, ids, weights)
        off = rows.tiers[picked].ravel() != _DEVICE
        if not off.any():
            return []
        return [store.table.blocks[i] for i in store.policy.promotions(ids[off], PROMOTE_PER_LAYER)]

    def count_reused(self, layer: int, blocks: int) -> None:
        """Sparse attention copied ``blocks`` full blocks that it keeps on the device into its staging: counted
        as a device gather (``bytes_moved["device->device"]``), like the blocks it reads from the device tier."""
        self._count(layer, Tier.DEVICE, blocks)

    def count_speculated(self, layer: int, blocks: int) -> None:
        """Sparse attention read ``blocks`` full disk blocks ahead of its selection (a speculation): counted in
        ``bytes_moved["disk->device"]`` when submitted, whether a selection uses them or not."""
        self._count(layer, Tier.DISK, blocks)

    def _count(self, layer: int, source: Tier, blocks: int) -> None:
        store = self.store
        store.transfer.count(link(source, Tier.DEVICE), blocks * store.block_tokens * store.layouts[layer].token_bytes)

    @recovering
    def promote(self, blocks: list[Block], data: torch.Tensor, keep: np.ndarray) -> int:
        """Move ``blocks`` (off-device, one layer) up to the device, writing ``data`` ``[n, 2, H_kv, block_tokens,
        D]`` (their bytes, already staged on the device by the read that attended them: no second read) with one
        batched write. Each takes a free device slot, or the slot of one of the device's coldest blocks that the
        policy likes less (those move down in one demotion, nothing is dropped; never one of ``keep``, the ids
        just attended). Returns how many moved; a promotion is optional, so no room is not an error."""
        store = self.store
        placement, policy = store.placement, store.policy
        pending = store.writeback.pending_ids
        chosen = [i for i, b in enumerate(blocks) if b.tier != Tier.DEVICE and b.id not in pending]
        if not chosen:
            return 0
        slot_bytes = blocks[chosen[0]].slot_bytes
        slots = placement.free_device_slots(slot_bytes, len(chosen))
        if len(slots) < len(chosen):
            exclude = placement.open_tails() | set(keep.ravel().tolist()) | {blocks[i].id for i in chosen}
            victims = policy.victims(Tier.DEVICE, slot_bytes, len(chosen) - len(slots), exclude)
            hot = chosen[len(slots):]  # blocks come hottest first, victims coldest first
            pairs = [(i, v) for i, v in zip(hot, victims) if policy.prefers(blocks[i], v)]
            if pairs:
                try:
                    placement.demote([v for _, v in pairs])
                except TierKVError:  # no room below (a full disk): the cache is consistent, nothing moves up
                    pairs = []
                slots += placement.free_device_slots(slot_bytes, len(pairs))
        chosen = chosen[: len(slots)]
        if not chosen:
            return 0
        # a failure from here on: recovery frees the slots taken (at most PROMOTE_PER_LAYER)
        placement.raise_to_device(store.layouts[blocks[chosen[0]].layer], [blocks[i] for i in chosen], slots,
                                  data[chosen])
        return len(chosen)
