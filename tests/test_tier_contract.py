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
