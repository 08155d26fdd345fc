"""Integrity of the disk tier: every block carries a checksum verified on read, so bytes changed on disk (any
byte, anywhere) raise IntegrityError and never come back as KV — checked with real byte flips in the tier's
own file, through both engines, at the store and through a real model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import kv, make_store
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import small_llama, tiny_model
from transformers import DynamicCache

from tierkv import DiskTierError, IntegrityError, TieredCache, TierKVError, cuda_standin
from tierkv import settings as tierkv_settings
from tierkv.blocks import Tier
from tierkv.tiers import disk as disk_module
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskSlotFile


def reference_append(ref: dict, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    new = torch.stack((keys, values))
    ref[layer] = new if layer not in ref else torch.cat((ref[layer], new), dim=3)


def store_with_disk_blocks(directory: Path, engine: str = "posix"):
    """A store whose two layers hold most of their blocks on disk, and the reference K/V."""
    with tierkv_settings.override(disk_engine=engine):
        store = make_store(directory, device_slots=4, host_slots=2)
        ref: dict = {}
        for step in range(8):
            for layer in range(2):
                keys, values = kv(1, 3, seed=10 * step + layer)
                store.append(layer, keys, values)
                reference_append(ref, layer, keys, values)
    store.writeback.reap(wait=True)  # no background write in flight: the disk holds what the table says
    assert store.stats()["blocks"]["disk"] >= 6
    return store, ref


def disk_file(store) -> DiskSlotFile:
    return next(iter(store.tiers[Tier.DISK].files.values()))


def flip(path: Path, position: int, mask: int) -> None:
    """Change one byte of ``path`` on disk, as a failing drive or another program would (not through tierkv)."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, position)
        os.pwrite(fd, bytes([old[0] ^ mask]), position)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine", ["posix", "native"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_flipped_byte_raises_or_reads_back_exactly(engine, data):
    """A byte flipped anywhere in the file (any bit pattern): if a live block's slot holds it, every read of
    that block raises IntegrityError naming the file and slot; elsewhere reads are exact."""
    with tempfile.TemporaryDirectory() as directory:
        store, ref = store_with_disk_blocks(Path(directory), engine)
        slot_file = disk_file(store)
        size = slot_file.capacity * slot_file.slot_bytes
        position = data.draw(st.integers(0, size - 1), label="position")
        mask = data.draw(st.integers(1, 255), label="xor mask")
        flip(slot_file.path, position, mask)
        slot = position // slot_file.slot_bytes
        holder = [b for b in store.table.blocks.values() if b.tier == Tier.DISK and b.slot == slot]
        for layer, expected in ref.items():
            if holder and holder[0].layer == layer:
                with pytest.raises(IntegrityError, match=f"slot {slot} ") as info:
                    store.read_tokens(layer)
                assert str(slot_file.path) in str(info.value) and "cache.reset()" in str(info.value)
            else:
                torch.testing.assert_close(store.read_tokens(layer), expected, rtol=0, atol=0)
        store.check()
        store.close()


def test_checksums_are_per_block_and_follow_slot_reuse(tmp_path):
    """A freed slot's checksum is dropped (reading it is refused as never written), and a slot written again
    verifies against its new contents."""
    store, ref = store_with_disk_blocks(tmp_path)
    slot_file = disk_file(store)
    assert slot_file.written.sum() == store.stats()["blocks"]["disk"]
    store.reset()
    assert not slot_file.written.any()
    with pytest.raises(IntegrityError, match="never written"):
        store.transfer.read_blocks(store.layouts.get(0) or _layout(), Tier.DISK, [0])
    keys, values = kv(1, 20, seed=7)
    store.append(0, keys, values)
    store.demote(list(store.table.blocks.values()))
    store.demote(list(store.table.blocks.values()))
    torch.testing.assert_close(store.read_tokens(0), torch.stack((keys, values)), rtol=0, atol=0)
    store.close()


def _layout():
    from tierkv.layout import BlockLayout

    return BlockLayout(2, 8, 4, torch.float32)


def test_reads_larger_than_the_bounce_limit_run_in_verified_rounds(tmp_path, monkeypatch):
    """A read of more than BOUNCE_BYTES goes through two halves of one bounce buffer, each round verified."""
    layout = _layout()
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", 4 * layout.slot_bytes)  # rounds of 2 slots
    tier = disk_module.DiskTier(tmp_path, budget=64 * layout.slot_bytes, extent_bytes=16 * layout.slot_bytes)
    slots = np.array([tier.alloc(layout.slot_bytes) for _ in range(9)], dtype=np.int64)
    data = torch.randn(9, *layout.shape)
    scratch = Scratch(BounceBuffer)
    tier.write_from(layout, slots, data, scratch)
    order = slots[::-1].copy()
    out = torch.empty(9, *layout.shape)
    read = tier.start_read(layout, order, scratch)
    assert read.rounds == 5 and sum(h.nbytes for h in read.halves) <= 4 * layout.slot_bytes
    read.finish([(0, 4, out[:4]), (4, 9, out[4:])])
    torch.testing.assert_close(out, data.flip(0), rtol=0, atol=0)
    assert scratch.bounce_buffer("read").nbytes <= 4 * layout.slot_bytes
    flip(next(iter(tier.files.values())).path, int(slots[1]) * layout.slot_bytes + 100, 0x40)
    with pytest.raises(IntegrityError, match=f"slot {int(slots[1])} "):
        tier.start_read(layout, order, scratch).finish([(0, 9, out)])
    tier.close()


@pytest.fixture(scope="module")
def model():
    return small_llama()


@pytest.mark.parametrize("where", ["sign and exponent", "low mantissa", "padding"])
def test_flipped_bytes_never_reach_the_logits(model, tmp_path, where):
    """Regression (the issue's first fault): bytes flipped in a disk-tier file gave silently wrong (or NaN)
    logits. Now the next step raises IntegrityError, the cache keeps every layer at one length, and after
    ``reset()`` it decodes exactly again."""
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        model(ids, past_key_values=cache)
        slot_file = next(iter(cache.store.tiers[Tier.DISK].files.values()))
        block = next(b for b in cache.store.table.blocks.values() if b.tier == Tier.DISK)
        layout = cache.store.layouts[block.layer]
        start = block.slot * slot_file.slot_bytes
        offset = {"sign and exponent": 3, "low mantissa": 0, "padding": layout.block_bytes + 5}[where]
        if offset >= slot_file.slot_bytes:
            pytest.skip("this layout's blocks fill their slots")
        flip(slot_file.path, start + offset, 0x7F)
        length = cache.get_seq_length()
        with pytest.raises(IntegrityError) as info:
            model(ids[:, -1:], past_key_values=cache)
        assert isinstance(info.value, TierKVError) and isinstance(info.value, OSError)
        assert str(slot_file.path) in str(info.value)
        assert all(layer.get_seq_length() == length for layer in cache.layers)
        cache.store.check()
        cache.reset()
        reference = DynamicCache()
        got = model(ids, past_key_values=cache).logits
        torch.testing.assert_close(got, model(ids, past_key_values=reference).logits)


def test_a_truncated_file_is_a_clear_disk_error(tmp_path):
    """Someone truncates the tier's file: reads hit end of file, an EIO DiskTierError naming the file that says the
    blocks past its end are lost and why (not that the blocks accepted are intact, as a failed read or write says)."""
    store, _ = store_with_disk_blocks(tmp_path)
    slot_file = disk_file(store)
    os.truncate(slot_file.path, 0)
    layer = next(b.layer for b in store.table.blocks.values() if b.tier == Tier.DISK)
    with pytest.raises(DiskTierError, match="end of file.*another program truncated or replaced it") as info:
        store.read_tokens(layer)
    assert str(slot_file.path) in str(info.value) and "intact" not in str(info.value)
    store.check()
    store.close()



def test_rounds_follow_the_gpu_protocol_on_the_standin(tmp_path, monkeypatch):
    """The CUDA path of reads in rounds (pinned halves, landing buffer, each half reused only after an event
    says the GPU copied it out), on the CPU stand-in: exact tokens, and no access its race detector flags."""
    model = tiny_model("llama")
    monkeypatch.setattr(disk_module, "BOUNCE_BYTES", 2 * 4096)  # rounds of one slot: the two halves alternate
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=DynamicCache())
    later_rounds = []
    submit = disk_module._DiskRead._submit

    def counting(self, k):
        later_rounds.append(k) if k else None
        submit(self, k)

    monkeypatch.setattr(disk_module._DiskRead, "_submit", counting)
    with tierkv_settings.override(cuda_standin=True, prefetch_min=0):
        standin = cuda_standin.fresh()
        budget = TieredCache.min_device_bytes(model.config, 64, block_tokens=4, device="cpu") + 8 * 1024
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4,
                         config=model.config) as cache:
            out = model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
            assert cache.stats()["blocks"]["disk"] >= 8 and cache.stats()["mover"] == "cuda-stream"
    assert torch.equal(out, ref)
    standin.check()
    assert max(later_rounds) >= 2  # a half was reused within one read
