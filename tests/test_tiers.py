"""Slot bookkeeping and memory-tier budgets."""

import pytest
import torch

from tierkv.blocks import Tier
from tierkv.layout import BlockLayout
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer
from tierkv.tiers.memory import FIRST_CHUNK_BYTES, MemoryTier
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


def test_a_pool_grows_with_its_blocks_not_with_the_budget():
    """Memory is taken by need: 4.6 MB of blocks on a 20 GB budget hold under twice their bytes plus the first
    chunk, in chunks that double (the budget's 1/16, 1.25 GB, was taken before); the chunks stop growing at
    ``chunk_bytes`` and the budget still bounds them."""
    slot = 64 * 1024
    tier = MemoryTier(Tier.DEVICE, budget=20 * 10**9, device=torch.device("cpu"))
    held = 70 * slot  # 4.6 MB
    assert None not in [tier.alloc(slot) for _ in range(70)]
    assert held <= tier.allocated_bytes <= 2 * held + FIRST_CHUNK_BYTES
    chunks = [chunk.numel() for chunk in tier.pools[slot].chunks]
    assert chunks == [FIRST_CHUNK_BYTES, FIRST_CHUNK_BYTES, 2 * FIRST_CHUNK_BYTES, 4 * FIRST_CHUNK_BYTES]

    capped = MemoryTier(Tier.HOST, budget=40 * slot, device=torch.device("cpu"), chunk_bytes=8 * slot)
    taken = [capped.alloc(slot) for _ in range(42)]
    assert taken[40:] == [None, None] and capped.peak_bytes <= capped.budget
    assert max(chunk.numel() for chunk in capped.pools[slot].chunks) == 8 * slot


def test_blocks_of_a_layer_take_consecutive_slots_in_sequence_order():
    """Blocks of two layers arriving interleaved and out of order still sit side by side, in index order."""
    slots = FreeSlots()
    slots.grow(64)
    order = [(0, 3), (1, 0), (0, 0), (1, 2), (0, 1), (1, 1), (0, 2), (1, 3)]
    got = {near: slots.alloc(near) for near in order}
    for layer in (0, 1):
        mine = [got[(layer, index)] for index in range(4)]
        assert mine == list(range(mine[0], mine[0] + 4))
    assert len(set(got.values())) == len(order)


def test_reserved_slots_are_reclaimed_when_nothing_else_is_free():
    slots = FreeSlots()
    slots.grow(20)
    taken = [slots.alloc((layer, 0)) for layer in range(2)]  # each layer reserves a run of 16 (or what is left)
    assert taken == [0, 16]
    assert slots.alloc() is None  # every other slot is reserved
    assert slots.reclaim() and not slots.reclaim()
    assert [slots.alloc() for _ in range(3)] == [1, 2, 3] and slots.used == 5


def test_memory_tier_gathers_into_a_strided_destination():
    from tierkv.layout import BlockLayout

    layout = BlockLayout(2, 8, 4, torch.float32)
    tier = MemoryTier(Tier.HOST, budget=64 * layout.slot_bytes, device=torch.device("cpu"),
                      chunk_bytes=3 * layout.slot_bytes)  # several chunks: one index_select per chunk run
    slots = [tier.alloc(layout.slot_bytes) for _ in range(8)]
    data = torch.randn(8, *layout.shape)
    import numpy as np

    from tierkv.tiers.base import Scratch
    from tierkv.tiers.disk import BounceBuffer

    tier.write_from(layout, np.asarray(slots), data, Scratch(BounceBuffer))
    order = np.asarray([slots[i] for i in (5, 0, 7, 2)])
    staging = torch.zeros(6, *layout.shape).transpose(0, 1)  # strided rows
    tier.start_read(layout, order, Scratch(BounceBuffer)).finish([(0, 4, staging[:, 1:5].transpose(0, 1))])
    torch.testing.assert_close(staging[:, 1:5].transpose(0, 1), data[[5, 0, 7, 2]], rtol=0, atol=0)


def test_scratch_buffers_are_per_thread():
    """Regression: scratch buffers were keyed on the creating thread, so a second caller thread shared the
    mover's bounce buffer (corrupted K after a crop with prefetch_depth=2)."""
    import threading

    from tierkv.tiers.base import Scratch
    from tierkv.tiers.disk import BounceBuffer

    scratch = Scratch(BounceBuffer)
    addresses = []
    alive = threading.Barrier(3)  # every thread holds its buffer until all have one (no address reuse)

    def grab() -> None:
        addresses.append(scratch.bounce(8192, "read").ctypes.data)
        if threading.current_thread() is not threading.main_thread():
            alive.wait()

    grab()  # the main thread's first, so no thread's freed buffer can come back at its address
    threads = [threading.Thread(target=grab) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(addresses)) == 4
    assert scratch.bounce(4096, "read").ctypes.data == addresses[0]  # reused on the same thread
    assert scratch.bounce(4096, "write").ctypes.data != addresses[0]  # ... per purpose


def test_a_disk_file_whose_engine_fails_to_open_leaks_nothing(tmp_path, monkeypatch):
    """Regression: DiskSlotFile kept its descriptor (and its file) when the engine failed to open."""
    import os

    from tierkv.errors import TierKVError
    from tierkv.tiers import disk as disk_module

    def broken(*args, **kwargs):
        raise TierKVError("engine failed")

    tier = disk_module.DiskTier(tmp_path, budget=2**20)
    monkeypatch.setattr(disk_module, "open_disk_file", broken)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(TierKVError, match="engine failed"):
        tier.alloc(4096)
    assert len(os.listdir("/proc/self/fd")) == before
    assert not list(tmp_path.glob("tierkv-*.kv"))
    tier.close()


def test_slabs_are_the_chunks_as_blocks_with_slot_ids_counting_on():
    layout = BlockLayout(2, 8, 4, torch.float32)
    tier = MemoryTier(Tier.HOST, budget=8 * layout.slot_bytes, device=torch.device("cpu"),
                      chunk_bytes=3 * layout.slot_bytes)
    assert tier.slabs(layout) == []
    slots = [tier.alloc(layout.slot_bytes) for _ in range(7)]
    data = torch.randn(7, *layout.shape)
    tier.write_from(layout, torch.tensor(slots).numpy(), data, Scratch(BounceBuffer))
    slabs = tier.slabs(layout)
    assert [slab.shape[0] for slab in slabs] == [3, 3, 2]
    torch.testing.assert_close(torch.cat(slabs)[slots], data, rtol=0, atol=0)
