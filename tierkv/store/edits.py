"""The table edits behind :class:`~tierkv.store.kvstore.KVStore`'s append (in two phases) and crop.

Append (its general path, when the decode step's fast path — tokens that fit every row's open device tail —
does not apply: a prefill, a tail that fills, a shared or demoted tail): :func:`allocate` the blocks each row
takes, :func:`write` the new tokens into them, then :func:`commit`. The first phase may fail (the store then frees
what was allocated); the commit only edits the table in memory and runs with interrupts deferred. Crop is
:func:`cut` alone: a cut block the rows share stays shared (the next append copies it on write), so it reads and
allocates nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tierkv.blocks import Block, LayerRows, Tier
from tierkv.errors import InvalidConfigError
from tierkv.layout import BlockLayout
from tierkv.store.transfer import link

if TYPE_CHECKING:
    from tierkv.store.kvstore import KVStore


@dataclass(frozen=True, slots=True)
class Split:
    """How ``tokens`` appended to rows of ``length`` tokens fall on blocks of ``block_tokens``: ``take`` of them
    into the partial tail column (which holds ``held``), the ``rest`` into ``new_columns`` new columns."""

    held: int
    take: int
    rest: int
    new_columns: int

    @classmethod
    def of(cls, length: int, tokens: int, block_tokens: int) -> Split:
        held = length % block_tokens  # 0: there is no partial tail column
        take = min(block_tokens - held, tokens) if held else 0
        return cls(held, take, tokens - take, math.ceil((tokens - take) / block_tokens))


@dataclass(slots=True)
class NewBlocks:
    """What one row takes in an append: tokens written in place into its open device tail, a copy of a
    shared or demoted tail (copy-on-write), then new blocks (the last one the new open tail)."""

    in_place: int = 0
    tail_copy: Block | None = None
    blocks: list[Block] = field(default_factory=list)


def layout_for(store: KVStore, layer: int, keys: torch.Tensor, values: torch.Tensor) -> BlockLayout:
    """The layout of ``layer``'s new ``keys``/``values``, checked against what the layer held before (the store
    checks a known layer's geometry itself; this builds the layout of a new one, or says what changed)."""
    device = store.device.device
    if keys.shape != values.shape:
        raise InvalidConfigError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape.")
    layout = BlockLayout.of(keys, store.block_tokens)
    known = store.layouts.setdefault(layer, layout)
    if known != layout:
        raise InvalidConfigError(
            f"layer {layer} changed geometry from {known} to {layout}; one TieredCache serves one model — "
            "create a new cache for another model."
        )
    if keys.device != device:
        raise InvalidConfigError(
            f"layer {layer} keys are on {keys.device} but the cache's device tier is on {device}; "
            "keep the model on one device, or create the cache after moving the model."
        )
    return layout


def allocate(store: KVStore, layer: int, rows: LayerRows, split: Split, layout: BlockLayout,
             allocated: list[Block]) -> list[NewBlocks]:
    """Allocate what each row needs for the split's tokens (each new block is added to ``allocated``).

    Each row's last new block becomes its open tail and must be on the device; those are allocated
    first, so the top-down placement of the other (full) new blocks cannot crowd them out.
    """
    table, placement = store.table, store.placement
    held, take, new_columns = split.held, split.take, split.new_columns
    first_index = rows.front + rows.count
    plans = [NewBlocks() for _ in range(rows.batch)]
    protect: set[int] = set()

    def device_block(index: int) -> Block:
        slot = placement.alloc_device(layout.slot_bytes, protect, (layer, index))
        block = table.new_block(layer, Tier.DEVICE, slot, layout.slot_bytes, index)
        allocated.append(block)
        protect.add(block.id)
        return block

    def placed_block(index: int) -> Block:
        tier, slot = placement.alloc_top_down(layout.slot_bytes, (layer, index))
        block = table.new_block(layer, tier, slot, layout.slot_bytes, index)
        allocated.append(block)
        return block

    copy_on_write = []
    for r, plan in enumerate(plans):
        if held:
            tail = table.tail(layer, r)
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


def write(store: KVStore, layer: int, layout: BlockLayout, plans: list[NewBlocks], kv: torch.Tensor,
          split: Split) -> None:
    """Copy the appended tokens ``kv`` ``[2, B, H_kv, q, D]`` into their blocks: in place into open tails, whole
    (zero-padded) blocks elsewhere, one batched write per tier."""
    bt, transfer = store.block_tokens, store.transfer
    held, take = split.held, split.take
    by_tier: dict[Tier, tuple[list[int], list[torch.Tensor]]] = {}  # slots and their blocks, in pieces
    for r, plan in enumerate(plans):
        if plan.in_place:
            tail = store.table.tail(layer, r)
            store.device.block(layout, tail.slot)[:, :, held : held + take].copy_(kv[:, r, :, :take])
        if plan.tail_copy is not None:
            old = store.table.tail(layer, r)
            data = transfer.read_blocks(layout, old.tier, [old.slot])[0]
            data[:, :, held : held + take].copy_(kv[:, r, :, :take])
            data[:, :, held + take :].zero_()
            transfer.count(link(old.tier, Tier.DEVICE), held * layout.token_bytes)
            slots, datas = by_tier.setdefault(plan.tail_copy.tier, ([], []))
            slots.append(plan.tail_copy.slot)
            datas.append(data[None])
        if plan.blocks:
            blocks = _as_blocks(kv[:, r, :, take:], len(plan.blocks), layout)  # [n, 2, H_kv, bt, D]
            tiers = [block.tier for block in plan.blocks]
            for tier in dict.fromkeys(tiers):  # each tier's blocks as one piece (a cat of many is slow)
                picked = [i for i, t in enumerate(tiers) if t == tier]
                slots, datas = by_tier.setdefault(tier, ([], []))
                slots.extend(plan.blocks[i].slot for i in picked)
                datas.append(blocks if len(picked) == len(tiers) else
                             blocks[torch.tensor(picked, device=blocks.device)])
    for tier, (slots, datas) in by_tier.items():
        transfer.write_blocks(layout, tier, slots, datas[0] if len(datas) == 1 else torch.cat(datas))
        if tier != Tier.DEVICE:
            transfer.count(link(Tier.DEVICE, tier), len(slots) * bt * layout.token_bytes)


def _as_blocks(tokens: torch.Tensor, count: int, layout: BlockLayout) -> torch.Tensor:
    """``tokens`` ``[2, H_kv, n, D]`` as ``count`` whole blocks ``[count, 2, H_kv, bt, D]``, contiguous, zero after
    the last token: one strided copy (torch.cat of the blocks as views costs ~10x more on the CPU)."""
    bt = layout.block_tokens
    blocks = torch.zeros((count, 2, layout.kv_heads, bt, layout.head_dim), dtype=layout.dtype, device=tokens.device)
    grid = blocks.permute(1, 2, 0, 3, 4)  # [2, H_kv, count, bt, D]
    full, extra = divmod(tokens.shape[2], bt)
    grid[:, :, :full].copy_(tokens[:, :, : full * bt].unflatten(2, (full, bt)))
    if extra:
        grid[:, :, full, :extra].copy_(tokens[:, :, full * bt :])
    return blocks


def filled_blocks(store: KVStore, layer: int, plans: list[NewBlocks], kv: torch.Tensor, split: Split,
                  length: int, summarise_from: int) -> list[tuple[Block, torch.Tensor]]:
    """The blocks this append (written, not yet committed) to rows of ``length`` tokens fills, with their keys and
    values ``[2, H_kv, block_tokens, D]``: tails filled in place or by their copy, and every full new block (from
    ``kv``) — but for those that end at or before token ``summarise_from`` (never the last). Only asked for while
    key summaries are kept."""
    bt, layout = store.block_tokens, store.layouts[layer]
    end = length + split.take + split.rest
    cut = min(summarise_from, end - 1)  # a block ending at or before ``cut`` is left out
    fills = split.held + split.take == bt and split.held > 0 and length + split.take > cut
    filled: list[tuple[Block, torch.Tensor]] = []
    for r, plan in enumerate(plans):
        if fills and plan.in_place:
            tail = store.table.tail(layer, r)
            filled.append((tail, store.device.block(layout, tail.slot)))
        elif fills and plan.tail_copy is not None:  # a shared or demoted tail, copied and filled (rare)
            copy = plan.tail_copy
            filled.append((copy, store.transfer.read_blocks(layout, copy.tier, [copy.slot])[0]))
        for k, block in enumerate(plan.blocks):
            if (k + 1) * bt <= split.rest and length + split.take + (k + 1) * bt > cut:
                filled.append((block, kv[:, r, :, split.take + k * bt : split.take + (k + 1) * bt]))
    return filled


def commit(store: KVStore, layer: int, rows: LayerRows, plans: list[NewBlocks], split: Split) -> None:
    """The append's table edits (in memory only; run with interrupts deferred, after the barrier)."""
    table, policy, bt = store.table, store.policy, store.block_tokens
    held, take, rest = split.held, split.take, split.rest
    for r, plan in enumerate(plans):
        if plan.in_place:
            table.tail(layer, r).tokens += plan.in_place
        if plan.tail_copy is not None:
            old = table.tail(layer, r)
            plan.tail_copy.tokens = held + take
            rows.put(r, rows.count - 1, plan.tail_copy)
            policy.on_insert(plan.tail_copy, store.tick)
            released = table.release(old.id)
            if released is not None:
                store.free_block(released, barrier=False)
    columns = len(plans[0].blocks) if plans else 0
    for k in range(columns):
        filled = min(bt, rest - k * bt)
        column = [plan.blocks[k] for plan in plans]
        for block in column:
            block.tokens = filled
            policy.on_insert(block, store.tick)
        rows.append_column(column)
    table.rows[layer] = rows


def cut(store: KVStore, layer: int, keep_tokens: int) -> None:
    """The crop of ``layer`` to ``keep_tokens`` per row: its table edits (in memory only; run with interrupts
    deferred, after the barrier). A cut block the rows share is cut once, for all of them (they all keep the same
    tokens of it)."""
    table, rows, bt = store.table, store.table.rows[layer], store.block_tokens
    keep_columns = -(-keep_tokens // bt)
    in_last = keep_tokens - (keep_columns - 1) * bt if keep_columns else 0
    for block_id in rows.ids[:, keep_columns:].ravel().tolist():
        released = table.release(block_id)
        if released is not None:
            store.free_block(released, barrier=False)
    rows.truncate(keep_columns)
    store.lengths[layer] = keep_tokens
    if not keep_columns:
        return
    for block_id in dict.fromkeys(rows.ids[:, keep_columns - 1].tolist()):
        block = table.blocks[block_id]
        if block.tokens > in_last:
            block.tokens = in_last
            if block.tier == Tier.DEVICE:  # no stale bytes past the tokens (a demoted cut is copied on write)
                store.device.block(store.layouts[layer], block.slot)[:, :, in_last:].zero_()
