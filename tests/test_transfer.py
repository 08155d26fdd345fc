"""Data movement (tierkv.store.transfer): reads from every tier into strided staging, byte counts per link, reads
ahead, and slot copies in bounded rounds — against the K/V that was appended."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import SLOT, kv, make_store

from tierkv.blocks import Tier
from tierkv.layout import SlotBytes
from tierkv.store import LINKS
from tierkv.store.transfer import PartTiming, link


def spread(tmp_path, tokens: int = 30):
    """A store whose one layer (2 rows) sits on all three tiers, and the K/V appended to it ``[2, B, H, T, D]``."""
    store = make_store(tmp_path, device_slots=32, host_slots=32)
    keys, values = kv(2, tokens, seed=4)
    store.append(0, keys, values)
    rows = store.table.rows[0]
    blocks = [store.table.blocks[int(i)] for i in np.unique(rows.ids[:, :-1])]
    store.demote(blocks[: 2 * len(blocks) // 3])  # two thirds down to the host ...
    store.demote([b for b in blocks[: len(blocks) // 3]])  # ... half of them on to the disk
    assert {b.tier for b in store.table.blocks.values()} == {Tier.DEVICE, Tier.HOST, Tier.DISK}
    return store, torch.stack((keys, values))


def test_link_names_are_source_to_target():
    assert link(Tier.HOST, Tier.DEVICE) == "host->device" and link(Tier.DISK, Tier.DEVICE) == "disk->device"
    assert all(name == link(Tier[a.upper()], Tier[b.upper()]) for name in LINKS for a, b in [name.split("->")])


def test_a_read_lands_every_tiers_blocks_in_a_strided_destination_and_counts_each_link(tmp_path):
    store, expected = spread(tmp_path)
    layout, bt = store.layouts[0], store.block_tokens
    plan = store.plan_read(0, 0, 30)
    wide = torch.full((2, 2, 2, 40, 8 + 3), float("nan"))
    dest = wide[..., :8]  # strided: the read must land in place
    before = dict(store.bytes_moved)
    timings: list[PartTiming] = []
    store.transfer.read_into(layout, plan, dest, store.table.tail(0).tokens, timings)
    ends = [(timing.tier, timing.nbytes, timing.copies) for timing in timings]
    assert all(timing.begun <= timing.ended for timing in timings)
    torch.testing.assert_close(dest[..., :30, :], expected, rtol=0, atol=0)
    assert torch.isnan(wide[..., 8:]).all()  # nothing written beside the view
    moved = {name: store.bytes_moved[name] - before[name] for name in LINKS}
    assert [tier for tier, _, _ in ends] == [Tier.DEVICE, Tier.HOST, Tier.DISK]  # fastest part lands first
    for part in plan.parts:
        tail_short = part.tail_blocks * (bt - store.table.tail(0).tokens)
        nbytes = (part.blocks * bt - tail_short) * layout.token_bytes
        assert moved[link(part.tier, Tier.DEVICE)] == nbytes
        assert (part.tier, nbytes, len(part.runs)) in ends
    assert sum(moved.values()) == 2 * 30 * layout.token_bytes  # every token of both rows once
    store.close()


def test_a_disk_read_started_ahead_is_the_one_that_lands(tmp_path):
    store, expected = spread(tmp_path)
    layout = store.layouts[0]
    plan = store.plan_read(0, 0, 30)
    ahead = store.transfer.read_ahead(layout, plan, "ahead")
    assert ahead is not None
    submitted = []
    real = store.tiers[Tier.DISK].start_read
    store.tiers[Tier.DISK].start_read = lambda *a, **k: submitted.append(a) or real(*a, **k)
    dest = torch.empty(2, 2, 2, 32, 8)
    store.transfer.read_into(layout, plan, dest, store.table.tail(0).tokens, ahead=ahead)
    assert not submitted  # the disk part was not read a second time
    torch.testing.assert_close(dest[..., :30, :], expected, rtol=0, atol=0)
    assert store.transfer.read_ahead(layout, plan.only(Tier.HOST), "ahead") is None  # nothing on disk to start
    store.close()


def test_blocks_read_for_the_cold_paths_are_fresh_copies_on_the_asked_side(tmp_path):
    store, expected = spread(tmp_path)
    layout = store.layouts[0]
    block = next(b for b in store.table.blocks.values() if b.tier == Tier.DISK)
    for into in (Tier.DEVICE, Tier.HOST):
        data = store.transfer.read_blocks(layout, Tier.DISK, [block.slot], into=into)
        assert data.shape == (1, *layout.shape)
        row = int(np.nonzero(store.table.rows[0].ids == block.id)[0][0])
        column = block.index
        torch.testing.assert_close(data[0], expected[:, row, :, column * 4 : (column + 1) * 4], rtol=0, atol=0)
    store.close()


@pytest.mark.parametrize(("source", "target"), [(Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DISK),
                                                 (Tier.DEVICE, Tier.DISK)])
def test_slots_are_copied_as_bytes_in_rounds_bounded_like_a_bounce_buffer(tmp_path, monkeypatch, source, target):
    store = make_store(tmp_path, device_slots=8, host_slots=8)
    store.tiers[Tier.DISK].bounce_bytes = 2 * SLOT  # rounds of two slots
    raw = SlotBytes(SLOT)
    slots = {tier: [store.tiers[tier].alloc(SLOT) for _ in range(5)] for tier in (source, target)}
    data = torch.randint(0, 256, (5, SLOT), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    store.transfer.write_blocks(raw, source, slots[source], data)
    reads = []
    real = store.transfer.read_blocks
    monkeypatch.setattr(store.transfer, "read_blocks", lambda *a, **k: reads.append(len(a[2])) or real(*a, **k))
    store.transfer.copy_slots(SLOT, source, slots[source], target, slots[target])
    assert reads == [2, 2, 1]
    assert torch.equal(real(raw, target, slots[target], into=Tier.HOST).cpu(), data)
    for tier, taken in slots.items():
        for slot in taken:
            store.tiers[tier].free(SLOT, slot)
    store.close()
