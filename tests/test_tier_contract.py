"""The contract every storage tier keeps (device, host, disk): slots under a budget, reads and writes of
whole blocks into strided destinations, sequence-ordered placement, a clean close."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.blocks import Tier
from tierkv.layout import BlockLayout, SlotBytes
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskTier
from tierkv.tiers.memory import MemoryTier

LAYOUT = BlockLayout(2, 8, 4, torch.float32)  # 512-byte blocks in 4 KiB slots
SLOTS = 24


def device_tier(tmp_path):
    return MemoryTier(Tier.DEVICE, SLOTS * LAYOUT.slot_bytes, torch.device("cpu"), chunk_bytes=5 * LAYOUT.slot_bytes)


def host_tier(tmp_path):
    return MemoryTier(Tier.HOST, SLOTS * LAYOUT.slot_bytes, torch.device("cpu"), chunk_bytes=5 * LAYOUT.slot_bytes)


def disk_tier(tmp_path):
    return DiskTier(tmp_path / "disk", SLOTS * LAYOUT.slot_bytes, extent_bytes=5 * LAYOUT.slot_bytes)


@pytest.fixture(params=[device_tier, host_tier, disk_tier], ids=["device", "host", "disk"])
def tier(request, tmp_path):
    made = request.param(tmp_path)
    yield made
    made.close()


def test_slots_stay_within_the_budget_and_are_reused(tier):
    slots = [tier.alloc(LAYOUT.slot_bytes) for _ in range(SLOTS)]
    assert None not in slots and len(set(slots)) == SLOTS
    assert tier.alloc(LAYOUT.slot_bytes) is None
    assert tier.peak_bytes <= tier.budget and tier.used_bytes == SLOTS * LAYOUT.slot_bytes
    tier.free(LAYOUT.slot_bytes, slots[3])
    assert tier.alloc(LAYOUT.slot_bytes) == slots[3]


@pytest.mark.parametrize("layout", [LAYOUT, SlotBytes(LAYOUT.slot_bytes)], ids=["blocks", "raw slots"])
def test_written_blocks_read_back_into_strided_destinations(tier, layout):
    scratch = Scratch(BounceBuffer)
    slots = np.asarray([tier.alloc(LAYOUT.slot_bytes) for _ in range(6)])
    shape = layout.shape
    data = torch.randn(6, *shape) if layout is LAYOUT else torch.randint(0, 255, (6, *shape), dtype=torch.uint8)
    tier.write_from(layout, slots, data, scratch)
    out = torch.zeros(8, *shape, dtype=data.dtype).transpose(0, 1)  # rows strided, as staging views are
    order = [4, 1, 5, 0, 2]
    pending = tier.start_read(layout, slots[order], scratch)
    pending.finish([(0, 2, out[:, 0:2].transpose(0, 1)), (2, 5, out[:, 5:8].transpose(0, 1))])
    got = torch.cat((out[:, 0:2], out[:, 5:8]), dim=1).transpose(0, 1)
    torch.testing.assert_close(got, data[order], rtol=0, atol=0)
    pending.settle()  # idempotent after finish


@pytest.mark.parametrize("make", [host_tier, disk_tier], ids=["host", "disk"])
def test_a_layers_blocks_are_placed_in_sequence_order(make, tmp_path):
    """(Not the device tier: its blocks gather in place, so it reserves no runs; see MemoryTier.alloc.)"""
    tier = make(tmp_path)
    got = {(layer, index): tier.alloc(LAYOUT.slot_bytes, (layer, index)) for index in (2, 0, 3, 1) for layer in (0, 1)}
    for layer in (0, 1):
        mine = [got[(layer, index)] for index in range(4)]
        assert mine == list(range(mine[0], mine[0] + 4))
    tier.close()


@pytest.mark.parametrize("make", [device_tier, host_tier], ids=["device", "host"])
def test_a_memory_tier_names_the_chunk_to_empty_and_gives_it_back_for_staging(make, tmp_path):
    """The reserve / evacuate API the store uses instead of reaching into slab pools: a reservation that does not
    fit names the newest chunk; its blocks move out (here: one relocated within the tier with ``alloc_outside`` and
    ``copy_slot``, the others freed), the chunk goes back, and the reservation then fits."""
    tier = make(tmp_path)
    scratch = Scratch(BounceBuffer)
    size = LAYOUT.slot_bytes
    slots = [tier.alloc(size) for _ in range(12)]  # chunks of 5 slots: [0, 5), [5, 10), [10, 15)
    data = torch.randn(12, *LAYOUT.shape)
    tier.write_from(LAYOUT, np.asarray(slots), data, scratch)
    assert tier.room(size) == SLOTS - 12
    assert not tier.reserve(SLOTS * size - 10 * size)  # 14 slots of staging: only 12 are not blocks
    assert tier.evacuation() == (size, range(10, 15))
    assert tier.alloc_outside(size, range(10, 15)) is None  # every slot of the older chunks holds a block
    tier.free(size, slots[0])
    moved = tier.alloc_outside(size, range(10, 15))
    assert moved == slots[0]
    tier.copy_slot(size, slots[10], moved)
    tier.free(size, slots[10])
    tier.free(size, slots[11])
    assert tier.drop_chunk(size) == 5 * size
    assert tier.reserve(SLOTS * size - 10 * size) and tier.allocated_bytes <= tier.budget
    out = torch.empty(1, *LAYOUT.shape)
    tier.start_read(LAYOUT, np.asarray([moved]), scratch).finish([(0, 1, out)])
    torch.testing.assert_close(out[0], data[10], rtol=0, atol=0)
    tier.unreserve(SLOTS * size - 10 * size)
    assert tier.evacuation() == (size, range(5, 10))
    tier.close()
