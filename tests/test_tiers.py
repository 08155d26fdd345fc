"""Slot bookkeeping and memory-tier budgets."""

import pytest
import torch

from tierkv.blocks import Tier
from tierkv.tiers.memory import MemoryTier
from tierkv.tiers.slots import FreeSlots, growth_slots


def test_free_slots_lowest_first_and_misuse_is_loud():
    slots = FreeSlots()
    slots.grow(4)
    assert [slots.alloc() for _ in range(3)] == [0, 1, 2]
    slots.free(1)
    assert slots.alloc() == 1
    with pytest.raises(RuntimeError, match="not in use"):
        slots.free(3)
    with pytest.raises(RuntimeError, match="still hold blocks"):
        slots.shrink(2)
    slots.free(2)
    slots.shrink(2)
    assert slots.capacity == 2 and slots.alloc() is None


@pytest.mark.parametrize(("budget", "allocated", "expected"), [(100, 0, 5), (100, 80, 1), (100, 90, 0), (100, 40, 3)])
def test_growth_slots(budget, allocated, expected):
    assert growth_slots(budget, allocated, slot_bytes=20, step_bytes=100) == expected


def test_memory_tier_never_exceeds_budget_and_gives_chunks_back():
    tier = MemoryTier(Tier.HOST, budget=10 * 4096, device=torch.device("cpu"), chunk_bytes=4 * 4096)
    slots = [tier.alloc(4096) for _ in range(12)]
    assert slots[:10] == list(range(10)) and slots[10:] == [None, None]
    assert tier.peak_bytes <= tier.budget
    assert not tier.reserve(4096)  # full of blocks: the caller must evacuate
    for slot in slots[:10]:
        tier.free(4096, slot)
    assert tier.reserve(8 * 4096)  # empty chunks are released to make room
    assert tier.allocated_bytes <= tier.budget
