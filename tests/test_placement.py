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
    store, expected, generator = _grown_device()
    device = store.tiers[Tier.DEVICE]
    keys, values = (torch.randn(1, HEADS, 12, DIM, generator=generator) for _ in range(2))
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


def test_evacuation_keeps_the_newest_chunks_recently_read_blocks_and_demotes_the_least_recently_read():
    """The blocks that move down are the policy's victims over the whole tier: a block of the emptied chunk the
    policy wants kept takes the slot of a colder one outside it, so which blocks stay on the device never depends
    on where their slots are."""
    store, expected, _ = _grown_device()
    device = store.tiers[Tier.DEVICE]
    pool = device.pools[store.layouts[0].slot_bytes]
    newest = pool.last_chunk_slots()
    tails = {store.table.tail(layer).id for layer in range(2)}
    on_device = [b for b in store.table.blocks.values() if b.tier == Tier.DEVICE and b.id not in tails]
    hot = {b.id for b in on_device if b.slot in newest}
    cold = sorted((b for b in on_device if b.id not in hot), key=lambda b: b.id)
    assert hot and len(cold) >= len(hot)  # the chunk's blocks could all be kept
    for layer in range(2):  # every block read once, then the newest chunk's read again: those are the recent ones
        store.policy.on_access(layer, 1)
        store.policy.on_access(layer, 2, [b.id for b in on_device if b.id in hot and b.layer == layer])
    chunks = len(pool.chunks)
    staging = device.budget - device.allocated_bytes + 1  # one byte more than the room left: one chunk goes back
    store.reserve_device(staging)
    assert len(pool.chunks) == chunks - 1
    placed = {b.id: b for b in store.table.blocks.values()}
    assert all(placed[i].tier == Tier.DEVICE and placed[i].slot not in newest for i in hot)  # moved, not demoted
    demoted = [b for b in cold if placed[b.id].tier == Tier.HOST]
    assert len(demoted) == len(hot)  # as many blocks went down as the chunk held
    assert all(placed[i].tier == Tier.DEVICE for i in tails)
    store.check()
    for layer in range(2):
        torch.testing.assert_close(store.read_tokens(layer), expected[layer], rtol=0, atol=0)
    store.release_device(staging)
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


HEADS, DIM = 8, 64  # fp32, 16-token blocks: 64 KiB each


def _grown_device() -> tuple[KVStore, dict[int, torch.Tensor], torch.Generator]:
    """Two layers of 41 blocks (5.1 MiB) on a 64 MiB device whose pool grew by doubling chunks from
    FIRST_CHUNK_BYTES; the K/V appended per layer, and the generator for more."""
    device = MemoryTier(Tier.DEVICE, 64 * 2**20, torch.device("cpu"))
    host = MemoryTier(Tier.HOST, 64 * 2**20, torch.device("cpu"))
    store = KVStore(device, host, None, make_policy("lru"), 16)
    generator = torch.Generator().manual_seed(0)
    expected = {}
    for layer in range(2):
        keys, values = (torch.randn(1, HEADS, 40 * 16 + 5, DIM, generator=generator) for _ in range(2))
        store.append(layer, keys, values)
        expected[layer] = torch.stack((keys, values))
    return store, expected, generator
