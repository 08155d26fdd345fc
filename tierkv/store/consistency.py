"""What must hold between the block table, the tiers' slots and the write-back in flight, and how to restore it.

:func:`check` is for tests (after every operation); :func:`recover` runs on the failure path of every store
operation (see ``_recovering`` in :mod:`tierkv.store.kvstore`): an operation cut short by an error or a Ctrl-C
may have taken slots or created blocks it never recorded, and recovery gives them back.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from tierkv.atomic import deferred_interrupts
from tierkv.blocks import Tier

if TYPE_CHECKING:
    from tierkv.store.kvstore import KVStore


def check(store: KVStore) -> None:
    """Raise ``AssertionError`` if the table's invariants, the kept lengths or the slot accounting are broken:
    every slot in use on a tier holds exactly one live block, or a write-back in flight."""
    table = store.table
    table.check()
    held = collections.Counter((block.tier, block.slot_bytes) for block in table.blocks.values())
    places = {(block.tier, block.slot_bytes, block.slot) for block in table.blocks.values()}
    if len(places) != len(table.blocks):
        raise AssertionError("two live blocks share a slot")
    pending = store.writeback.pending
    if pending is not None:
        held[(Tier.DISK, pending.slot_bytes)] += len(pending.disk_slots)
    for kind, tier in store.tiers.items():
        for slot_bytes, used in tier.slot_counts().items():
            if used != held[(kind, slot_bytes)]:
                raise AssertionError(f"{kind.label} tier: {used} slots of {slot_bytes} bytes in use, but "
                                     f"{held[(kind, slot_bytes)]} blocks hold them (a leaked slot)")
    for layer in table.rows:
        if table.seq_length(layer) != store.seq_length(layer):
            raise AssertionError(f"layer {layer}: kept length {store.seq_length(layer)} != "
                                 f"{table.seq_length(layer)} in the table")


def recover(store: KVStore) -> None:
    """Forget blocks no row holds and give back every slot that no live block (or the write-back in flight)
    holds. O(blocks + slots)."""
    table = store.table
    with deferred_interrupts():
        store.unrecovered = False
        listed = set()
        for rows in table.rows.values():
            listed.update(rows.ids.ravel().tolist())
        for block_id in [i for i in table.blocks if i not in listed]:  # allocated, never committed
            block = table.blocks.pop(block_id)
            store.policy.on_release(block)
            if store.summaries is not None:
                store.summaries.release(block_id)
        held: dict[Tier, dict[int, set[int]]] = {kind: collections.defaultdict(set) for kind in store.tiers}
        for block in table.blocks.values():
            held[block.tier][block.slot_bytes].add(block.slot)
        pending = store.writeback.pending
        if pending is not None:
            held[Tier.DISK][pending.slot_bytes].update(pending.disk_slots)
        for kind, tier in store.tiers.items():
            tier.release_unheld(held[kind])
