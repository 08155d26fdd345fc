"""Regression tests for consistency bugs found in review: failed prefetches, rollbacks with sliding
windows and streaming, stale prefetches across mode switches, shared read buffers, transactional crops,
reset across dtypes, and use after close."""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch
from helpers import kv, make_store
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.blocks import Tier
from tierkv.errors import BudgetTooSmallError, CapacityError, DiskTierError, InvalidConfigError
from tierkv.hf import TieredCache
from tierkv.mover import ThreadMover
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier

BLOCK = 4


def on_mover_thread() -> bool:
    return threading.current_thread().name.startswith("tierkv-mover")


def lengths(cache: TieredCache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


# ------------------------------------------------------------------------------- 1. poisoned barrier
def test_failed_prefetch_does_not_poison_later_table_edits(tmp_path, monkeypatch):
    model = tiny_model("llama")
    cache = TieredCache(gpu_gb="1MB", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=BLOCK, config=model.config)
    keys, values = kv(1, 6, heads=2, dim=16)
    cache.update(keys, values, 0)
    real = KVStore.read_into

    def failing(self, *args, **kwargs):
        if on_mover_thread():
            raise DiskTierError(errno.EIO, "injected read failure")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(KVStore, "read_into", failing)
    cache.update(keys, values, 1)  # issues the (wrapping) prefetch of layer 0, which fails on the mover
    failure = cache.executor.pending[0].handle._future.exception()  # let it finish
    assert isinstance(failure, DiskTierError) and "injected" in str(failure)
    monkeypatch.setattr(KVStore, "read_into", real)
    cache.reorder_cache(torch.tensor([0]))  # barriers wait for the failed read but do not raise its error
    assert lengths(cache) == [6, 6] and not cache.executor.pending  # the edit went through; the prefetch is gone
    cache.reset()  # and the cache stays usable
    assert lengths(cache) == [0, 0]
    got_keys, got_values = cache.update(keys, values, 0)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)  # read afresh, exact
    assert lengths(cache) == [6, 0]
    cache.close()


# ------------------------------------------------------------------------- 2. rollback vs sliding drop
def test_failed_step_rolls_back_sliding_layers(tmp_path, monkeypatch):
    model = tiny_model("gemma2", "eager", 8)  # layer 0 sliding (window 8), layer 1 full
    cache = TieredCache(gpu_gb="4MB", cpu_gb="1MB", block_tokens=BLOCK, config=model.config)
    real = KVStore.append
    fail = {"armed": False}

    def append(self, layer, k, v, *args, **kwargs):
        if layer == 1 and fail["armed"]:
            raise CapacityError("injected: the KV cache no longer fits")
        return real(self, layer, k, v, *args, **kwargs)

    monkeypatch.setattr(KVStore, "append", append)
    keys, values = kv(1, 11, heads=2, dim=16)
    for layer in range(2):
        cache.update(keys, values, layer)
    for step in range(3):
        k1, v1 = kv(1, 1, heads=2, dim=16, seed=step + 1)
        for layer in range(2):
            cache.update(k1, v1, layer)
    assert lengths(cache) == [14, 14]
    fail["armed"] = True  # layer 0 takes token 15 and frees a block (11 stored -> 7 = window - 1)
    k1, v1 = kv(1, 1, heads=2, dim=16, seed=9)
    cache.update(k1, v1, 0)
    with pytest.raises(CapacityError):
        cache.update(k1, v1, 1)
    assert lengths(cache) == [14, 14]
    cache.close()


# ------------------------------------------------------------------- 3. streaming errors not rolled back
def test_streaming_failure_keeps_layers_consistent(tmp_path):
    model = tiny_model("llama")
    ids, mask = prompt(1, 12, seed=3)
    with TieredCache(gpu_gb="96KiB", cpu_gb="1MB", disk_dir=tmp_path, block_tokens=BLOCK) as cache:
        model(ids, attention_mask=mask, past_key_values=cache)  # exact gather fits in the budget
        assert lengths(cache) == [12, 12]
        nxt = torch.tensor([[5]])
        mask = torch.cat((mask, torch.ones_like(nxt)), dim=1)
        with pytest.raises(BudgetTooSmallError), cache.streaming(model):  # 2 x 4096-token chunks do not fit
            model(nxt, attention_mask=mask, past_key_values=cache)
        assert lengths(cache) == [12, 12]


# ------------------------------------------------------- 4. stale prefetch after sliding drops (mode switch)
def test_prefetch_is_invalidated_by_sliding_drops_across_mode_switch(tmp_path):
    model = tiny_model("gemma2", "eager", 8)
    ids, mask = prompt(1, 13, seed=21)
    reference = DynamicCache()
    worst = 0.0
    with TieredCache(gpu_gb="4MB", cpu_gb="1MB", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache:
        expected = model(ids, attention_mask=mask, past_key_values=reference).logits[:, -1]
        model(ids, attention_mask=mask, past_key_values=cache)
        token = expected.argmax(-1, keepdim=True)
        for step in range(15):
            mask = torch.cat((mask, torch.ones_like(token)), dim=1)
            expected = model(token, attention_mask=mask, past_key_values=reference).logits[:, -1]
            if step % 5:  # 4 streaming steps (one block of drops), then one exact step
                with cache.streaming(model, chunk_tokens=8):
                    got = model(token, attention_mask=mask, past_key_values=cache).logits[:, -1]
            else:
                got = model(token, attention_mask=mask, past_key_values=cache).logits[:, -1]
            worst = max(worst, (got - expected).abs().max().item())
            token = expected.argmax(-1, keepdim=True)
    assert worst < 1e-5


# ------------------------------------------------------------------------------ 5. reset keeps layouts
def test_reset_allows_another_dtype(tmp_path):
    cache = TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=BLOCK)
    keys, values = kv(1, 5, heads=2, dim=16)
    cache.update(keys, values, 0)
    cache.reset()
    got, _ = cache.update(keys.to(torch.bfloat16), values.to(torch.bfloat16), 0)
    assert got.dtype == torch.bfloat16
    cache.close()


# ---------------------------------------------------- 6. read bounce buffer shared by mover and caller
def test_sync_read_does_not_clobber_an_inflight_prefetch(tmp_path, monkeypatch):
    layers = 3
    store = make_store(tmp_path, device_slots=16, host_slots=16, staging_bytes=2**16)
    executor = ExactGather(store, ThreadMover(), prefetch_depth=2)
    executor.num_layers, executor.layers_known = layers, True
    reference = {}
    for layer in range(layers):
        keys, values = kv(1, 16, seed=layer)
        store.append(layer, keys, values)
        reference[layer] = torch.stack((keys, values))
        full = [store.table.blocks[b] for b in store.table.rows[layer][0][:-1]]
        store.demote(full)  # device -> host
        store.demote(full)  # host -> disk
    assert store.stats()["blocks"]["disk"] >= 2 * layers
    real = DiskTier.start_read

    def slow_disk(self, layout, slots, scratch, *args):
        if not on_mover_thread():
            time.sleep(0.05)  # let the in-flight prefetch read first: the clobbered side is then deterministic
        pending = real(self, layout, slots, scratch, *args)
        if on_mover_thread():
            pending.handle.wait()
            time.sleep(0.3)  # a slow disk: the window between a job's read and its scatter
        return pending

    monkeypatch.setattr(DiskTier, "start_read", slow_disk)
    executor.gather(Span.of(store, 0, 0))  # prefetches layers 1 and 2
    k1, _ = executor.gather(Span.of(store, 1, 1))  # a miss (other start): a synchronous read of disk blocks of layer 1
    torch.testing.assert_close(k1, reference[1][0][:, :, 1:], rtol=0, atol=0)
    k2, v2 = executor.gather(Span.of(store, 2, 0))  # hit: the prefetch issued by gather(0)
    torch.testing.assert_close(k2, reference[2][0], rtol=0, atol=0)
    torch.testing.assert_close(v2, reference[2][1], rtol=0, atol=0)
    executor.close()
    store.close()


# ------------------------------------------------------------- 7. crop of a shared disk tail: nothing read
def test_a_crop_through_a_shared_disk_tail_reads_nothing_and_the_next_append_copies_it(tmp_path, monkeypatch):
    """A crop through a block the rows share cuts it where it is (it read the block to copy it for each row, so a
    failing disk or a full device failed the crop, and a cache's crop after some layers were cut); the next append
    copies it on write, and every row reads back its tokens."""
    store = make_store(tmp_path, device_slots=8, host_slots=8)
    keys, values = kv(1, 12)
    store.append(0, keys, values)
    tail = store.table.blocks[store.table.rows[0][0][-1]]
    store.demote([tail])
    store.demote([tail])
    assert tail.tier == Tier.DISK
    store.select_rows([0, 0])  # rows share every block, the (full) tail on disk included
    disk = store.tiers[Tier.DISK]
    real_read = disk.read

    def broken(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk, "read", broken)
    device_used = store.device.used_bytes
    store.crop(0, 2)
    assert store.device.used_bytes == device_used and tail.refcount == 2 and tail.tokens == 2
    monkeypatch.setattr(disk, "read", real_read)
    more_keys, more_values = kv(2, 3, seed=1)
    store.append(0, more_keys, more_values)
    store.check()
    got = store.read_tokens(0)
    for row in range(2):
        torch.testing.assert_close(got[0, row], torch.cat((keys[0, :, :10], more_keys[row]), dim=1), rtol=0, atol=0)
        torch.testing.assert_close(got[1, row], torch.cat((values[0, :, :10], more_values[row]), dim=1), rtol=0,
                                   atol=0)
    store.close()


# ------------------------------------------------------------------ 8. reuse after close is refused
def test_cache_reused_after_close_is_refused_and_leaves_no_files(tmp_path):
    cache = TieredCache(gpu_gb="48KB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=BLOCK)
    keys, values = kv(1, 64, heads=2, dim=16)
    cache.update(keys, values, 0)
    cache.close()
    assert not list(tmp_path.glob("tierkv-*"))
    with pytest.raises(InvalidConfigError, match="closed"):
        cache.update(keys, values, 0)
    cache.close()  # idempotent
    assert not list(tmp_path.glob("tierkv-*"))  # ... so its files must go too
