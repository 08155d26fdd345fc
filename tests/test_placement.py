"""Placement (tierkv.store.placement): where new blocks go, demotion down the chain, promotion up, and the
evacuation that makes room for staging — each checked against the K/V appended and the store's invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SLOT, kv, make_store

from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError, CapacityError
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.memory import FIRST_CHUNK_BYTES, MemoryTier


def test_new_blocks_take_the_fastest_tier_with_room_then_the_error_names_the_fix(tmp_path):
    store = make_store(tmp_path, device_slots=2, host_slots=3, disk_bytes=4 * SLOT, extent_slots=1)
    placement = store.placement
    tiers = [placement.alloc_top_down(SLOT, (0, index))[0] for index in range(9)]
    assert tiers == [Tier.DEVICE] * 2 + [Tier.HOST] * 3 + [Tier.DISK] * 4
    with pytest.raises(CapacityError, match=r"KV held: device .* host .* disk .*raise disk_gb"):
        placement.alloc_top_down(SLOT, (0, 9))
    store.tiers[Tier.DISK].free_all()
    for tier in (Tier.DEVICE, Tier.HOST):
        store.tiers[tier].free_all()
    store.close()


def test_demotion_skips_a_tier_with_no_room_and_keeps_every_token(tmp_path):
    """``cpu_gb=0`` with a disk tier: device blocks go straight to disk (device->disk), nothing is dropped."""
    store = make_store(tmp_path, device_slots=3, host_slots=0)
    keys, values = kv(1, 24, seed=2)
    store.append(0, keys, values)  # 6 blocks: more than the device holds
    store.check()
    assert {b.tier for b in store.table.blocks.values()} == {Tier.DEVICE, Tier.DISK}
    assert store.bytes_moved["device->disk"] > 0 and store.bytes_moved["device->host"] == 0
    torch.testing.assert_close(store.read_tokens(0), torch.stack((keys, values)), rtol=0, atol=0)
    store.close()


def test_a_full_device_demotes_the_policys_victim_but_never_a_protected_block_or_an_open_tail(tmp_path):
    store = make_store(tmp_path, device_slots=3, host_slots=8)
    store.append(0, *kv(1, 10))  # blocks 0, 1 full on the device, the open tail of 2 tokens there too
    blocks = sorted(store.table.blocks.values(), key=lambda b: b.index)
    assert [b.tier for b in blocks] == [Tier.DEVICE] * 3
    taken = store.placement.alloc_device(SLOT, protect={blocks[0].id}, near=(1, 0))
    assert (blocks[0].tier, blocks[1].tier, blocks[2].tier) == (Tier.DEVICE, Tier.HOST, Tier.DEVICE)
    with pytest.raises(BudgetTooSmallError, match="blocks being filled") as refused:  # a protected block, the tail
        store.placement.alloc_device(SLOT, protect={blocks[0].id}, near=(1, 1))
    need = store.tiers[Tier.DEVICE].reserved + 3 * SLOT  # in bytes: a rounded size can read as the budget itself
    assert f'gpu_gb="{need}B"' in str(refused.value)
    store.tiers[Tier.DEVICE].free(SLOT, taken)
    store.check()
    store.close()


def test_demote_any_moves_each_block_one_step_and_leaves_the_lowest_tier_alone(tmp_path):
    store = make_store(tmp_path, device_slots=8, host_slots=8)
    store.append(0, *kv(1, 16))
    first, second, third, _ = sorted(store.table.blocks.values(), key=lambda b: b.index)
    store.placement.demote_any([first, second])
    store.placement.demote_any([first, third])
    assert (first.tier, second.tier, third.tier) == (Tier.DISK, Tier.HOST, Tier.HOST)
    store.placement.demote_any([first])
    assert first.tier == Tier.DISK
    store.check()
    store.close()


def test_blocks_raised_to_the_device_read_back_and_are_counted(tmp_path):
    store = make_store(tmp_path, device_slots=8, host_slots=8)
    keys, values = kv(1, 18, seed=6)
    store.append(0, keys, values)
    full = sorted((b for b in store.table.blocks.values() if b.tokens == 4), key=lambda b: b.index)
    store.demote(full[:3])
    raised = full[:2]
    assert all(b.tier == Tier.HOST for b in raised)
    layout = store.layouts[0]
    data = store.transfer.read_blocks(layout, Tier.HOST, [b.slot for b in raised])  # on the device side
    slots = store.placement.free_device_slots(SLOT, 2)
    before = store.bytes_moved["device->device"]
    store.placement.raise_to_device(layout, raised, slots, data)
    assert [b.tier for b in raised] == [Tier.DEVICE] * 2 and [b.slot for b in raised] == slots
    assert store.placement.promoted == 2 == store.stats()["blocks_promoted"]
    assert store.bytes_moved["device->device"] - before == 2 * 4 * layout.token_bytes
    store.check()
    torch.testing.assert_close(store.read_tokens(0), torch.stack((keys, values)), rtol=0, atol=0)
    store.close()


def test_free_device_slots_takes_only_what_is_free(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=8)
    store.append(0, *kv(1, 10))  # 3 device blocks
    slots = store.placement.free_device_slots(SLOT, 5)
    assert len(slots) == 1 and all(b.tier == Tier.DEVICE for b in store.table.blocks.values())  # nothing demoted
    store.tiers[Tier.DEVICE].free(SLOT, slots[0])
    store.close()


def test_staging_evacuates_the_newest_chunk_of_a_pool_that_grew_by_need(tmp_path):
    """Default chunk sizes on a large budget (they double from FIRST_CHUNK_BYTES): a reservation that does not fit
    empties the newest chunk — full blocks demoted, open tails moved into older chunks — and gives it back."""
    heads, dim, bt = 8, 64, 16  # fp32: 64 KiB blocks
    device = MemoryTier(Tier.DEVICE, 64 * 2**20, torch.device("cpu"))
    host = MemoryTier(Tier.HOST, 64 * 2**20, torch.device("cpu"))
    store = KVStore(device, host, None, make_policy("lru"), bt)
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for layer in range(2):
        keys = torch.randn(1, heads, 40 * bt + 5, dim, generator=generator)  # 41 blocks a layer: 5.1 MiB in all
        values = torch.randn(1, heads, 40 * bt + 5, dim, generator=generator)
        store.append(layer, keys, values)
        expected[layer] = torch.stack((keys, values))
    keys, values = (torch.randn(1, heads, 12, dim, generator=generator) for _ in range(2))
    store.append(0, keys, values)  # the tail fills; the new one takes the lowest free slot, in the newest chunk
    expected[0] = torch.cat((expected[0], torch.stack((keys, values))), dim=3)
    pool = device.pools[store.layouts[0].slot_bytes]
    chunks = [chunk.numel() for chunk in pool.chunks]
    assert chunks == [FIRST_CHUNK_BYTES, FIRST_CHUNK_BYTES, 2 * FIRST_CHUNK_BYTES, 4 * FIRST_CHUNK_BYTES]
    newest = pool.last_chunk_slots()
    tails = [store.table.tail(layer) for layer in range(2)]
    assert tails[0].slot in newest
    staging = device.budget - device.allocated_bytes + 1  # one byte more than the room left
    store.reserve_device(staging)
    assert [chunk.numel() for chunk in pool.chunks] == chunks[:-1]  # the newest chunk went back
    assert device.allocated_bytes <= device.budget and device.reserved == staging
    assert all(t.tier == Tier.DEVICE and t.slot not in newest for t in tails)  # tails stay on the device
    assert store.stats()["blocks"]["host"] > 0
    store.check()
    for layer in range(2):
        torch.testing.assert_close(store.read_tokens(layer), expected[layer], rtol=0, atol=0)
    store.release_device(staging)
    assert device.reserved == 0
    store.close()


def test_staging_that_cannot_fit_beside_the_open_tails_says_how_much_would(tmp_path):
    store = make_store(tmp_path, device_slots=4, host_slots=8)
    store.append(0, *kv(2, 6))  # two rows: two open tails on the device
    with pytest.raises(BudgetTooSmallError, match=r"cannot hold the attention staging area .* raise gpu_gb"):
        store.reserve_device(4 * SLOT)
    assert store.device.reserved == 0
    store.check()
    assert np.all(store.table.rows[0].tiers[:, -1] == Tier.DEVICE)
    store.close()
