"""Background write-back of host blocks to disk: it happens, it loses nothing, and its failures are quiet."""

from __future__ import annotations

import errno

import pytest
import torch
from helpers import kv, make_store
from test_store import assert_matches, reference_append

from tierkv.blocks import Tier
from tierkv.errors import DiskFullError


class HeldHandle:
    """Wraps a real I/O handle and reports 'not done' until released, to control completion in a test."""

    def __init__(self, inner, fail: bool = False) -> None:
        self.inner, self.fail, self.released = inner, fail, False

    def done(self) -> bool:
        return self.released

    def wait(self) -> None:
        self.inner.wait()
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def held_writes(monkeypatch):
    """Make a store's disk writes complete only when the test releases them: returns the handles."""
    held: list[HeldHandle] = []

    def hold(store):
        disk = store.tiers[Tier.DISK]
        real_write = disk.write
        monkeypatch.setattr(disk, "write", lambda *a: held.append(HeldHandle(real_write(*a))) or held[-1])
        return held

    return hold


def fill(store, ref, steps, batch=2, layers=2, seed=0, tokens=3):
    for step in range(steps):
        for layer in range(layers):
            keys, values = kv(batch, tokens, seed=seed + step * 10 + layer)
            store.append(layer, keys, values)
            reference_append(ref, layer, keys, values)


def test_writeback_moves_prefill_writes_off_the_critical_path(tmp_path):
    direct = {}
    for enabled in (False, True):
        store = make_store(tmp_path / str(enabled), device_slots=6, host_slots=64)
        store.writeback.enabled = enabled
        ref: dict = {}
        fill(store, ref, 40, tokens=9)  # prefill-like chunks: full blocks are placed top-down
        store.writeback.reap(wait=True)
        assert_matches(store, ref)
        moved = store.stats()["bytes_moved"]
        direct[enabled] = moved["device->disk"]
        if enabled:
            assert moved["host->disk"] > 0
        store.close()
    # new blocks landed on the host and went down in the background instead of being written in append()
    assert direct[True] < direct[False] / 4


def test_blocks_stay_readable_while_their_write_is_in_flight(tmp_path, held_writes):
    store = make_store(tmp_path, device_slots=6, host_slots=8)
    held = held_writes(store)
    ref: dict = {}
    fill(store, ref, 8)
    assert store.writeback.pending is not None
    pending = store.writeback.pending_ids
    assert all(store.table.blocks[b].tier == Tier.HOST for b in pending)
    assert_matches(store, ref)  # read from the host copies
    held[-1].released = True
    store.writeback.reap()
    assert all(store.table.blocks[b].tier == Tier.DISK for b in pending if b in store.table.blocks)
    assert_matches(store, ref)
    store.close()


def test_released_while_in_flight_frees_the_disk_slots(tmp_path, held_writes):
    store = make_store(tmp_path, device_slots=6, host_slots=8)
    disk = store.tiers[Tier.DISK]
    held = held_writes(store)
    ref: dict = {}
    fill(store, ref, 8)
    assert store.writeback.pending is not None
    for layer in list(ref):  # crop everything: the in-flight blocks die before their write lands
        store.crop(layer, ref[layer].shape[3])
    held[-1].released = True
    store.writeback.reap()
    on_disk = sum(1 for b in store.table.blocks.values() if b.tier == Tier.DISK)
    assert disk.used_bytes == on_disk * disk.files[4096].slot_bytes
    store.close()


def test_failed_background_write_loses_nothing(tmp_path, monkeypatch, caplog):
    store = make_store(tmp_path, device_slots=6, host_slots=8)
    disk = store.tiers[Tier.DISK]
    real_write = disk.write
    monkeypatch.setattr(disk, "write", lambda *a: HeldHandle(real_write(*a), fail=True))
    ref: dict = {}
    with pytest.raises(DiskFullError):  # once the host is really full, the foreground reports the failure
        fill(store, ref, 40)
    assert store.writeback.paused_reason is not None
    assert "background write-back paused" in caplog.text
    assert_matches(store, ref)  # every accepted token still reads back
    assert disk.used_bytes == sum(b.slot_bytes for b in store.table.blocks.values() if b.tier == Tier.DISK)
    monkeypatch.undo()
    store.reset()  # resumes write-back
    assert store.writeback.paused_reason is None
    ref = {}
    fill(store, ref, 12, seed=500)
    assert_matches(store, ref)
    assert torch.count_nonzero(store.read_tokens(0)) > 0
    store.close()


def test_a_block_moved_while_its_write_back_is_in_flight_is_left_where_it_went(tmp_path, held_writes):
    """Regression (found by fuzzing the store): a block demoted by hand while its background write was in
    flight was then freed from the host at completion, as if it were still there."""
    store = make_store(tmp_path, device_slots=9, host_slots=1)
    held = held_writes(store)
    ref: dict = {}
    for layer in range(2):
        keys, values = kv(3, 5, seed=layer)
        store.append(layer, keys, values)
        reference_append(ref, layer, keys, values)
    pending = list(store.writeback.pending.blocks) if store.writeback.pending else []
    assert pending and held
    store.demote(pending)  # host -> disk now, while the background copy is still in flight
    for handle in held:
        handle.released = True
    store.writeback.reap(wait=True)
    assert all(block.tier == Tier.DISK for block in pending)
    assert_matches(store, ref)
    store.close()
