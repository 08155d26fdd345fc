"""A persisted chain stays reachable from its first block under eviction: a block is listed only beside the one
before it, and a save marks the blocks before it used, so a small store never fills with deep blocks no lookup
reaches (which kept the prompts that needed them from ever being reused again); a full store warns once per
directory per process, not once per cache."""

from __future__ import annotations

import logging

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.hf import cache_keyword
from tierkv.persist import record
from tierkv.persist.blockfile import Item, PersistentStore

BT = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _generate(model, ids: torch.Tensor, cache) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): cache},
                          max_new_tokens=3, do_sample=False)


def _cache(model, directory, capacity: int, **options) -> TieredCache:
    return TieredCache(gpu_gb="64MiB", cpu_gb="64MiB", block_tokens=BT, config=model.config, disk_dir=directory,
                       persist=True, persist_gb=f"{capacity}B", **options)


def _record_bytes(model, tmp_path) -> int:
    """The bytes of one block record of ``model``, as the store lists it."""
    ids, _ = prompt(1, 2 * BT, seed=5)
    with _cache(model, tmp_path / "measure", 1 << 20) as cache:
        cache.load_prefix(model, ids)
        _generate(model, ids, cache)
        cache.flush()
    store = PersistentStore(tmp_path / "measure", 1 << 20)
    try:
        sizes = {entry.nbytes for entry in store._listing().entries.values()}
    finally:
        store.close()
    assert len(sizes) == 1
    return sizes.pop()


def _item(key: str, depth: int, parent: str | None = None) -> Item:
    return Item(key, depth, *record.encode({"kind": "block", "key": key}, bytes(64)), parent=parent)


def test_a_block_whose_parent_is_not_listed_is_not_listed(tmp_path):
    store = PersistentStore(tmp_path, 1 << 20)
    try:
        root, child, orphan = "a" * 32, "b" * 32, "c" * 32
        assert store.put([_item(root, 0), _item(child, 1, parent=root)]) == 2
        assert store.put([_item(orphan, 1, parent="d" * 32)]) == 0
        assert orphan not in store and root in store and child in store
        assert not any((tmp_path / "tierkv-persist" / "tmp").rglob("*.tkv"))  # its staged file went too
    finally:
        store.close()


def test_a_prefix_evicted_while_a_cache_holds_it_is_reused_again(model, tmp_path):
    """A cache that loaded prompt P's prefix persists P's deeper blocks after another prompt evicted that prefix:
    they were listed without it, and every later run of P touched them and dropped P's own head for room."""
    capacity = 4 * _record_bytes(model, tmp_path)
    base, _ = prompt(1, 40, seed=1)
    other, _ = prompt(1, 40, seed=2)
    directory = tmp_path / "kv"
    with _cache(model, directory, capacity) as first:
        first.load_prefix(model, base)
        _generate(model, base, first)
    holder = _cache(model, directory, capacity)
    assert holder.load_prefix(model, base) == 4 * BT
    with _cache(model, directory, capacity) as evicting:
        assert evicting.load_prefix(model, other) == 0
        _generate(model, other, evicting)
    _generate(model, base, holder)
    holder.close()
    loaded = []
    for _ in range(2):
        with _cache(model, directory, capacity) as cache:
            loaded.append(cache.load_prefix(model, base))
            out = _generate(model, base, cache)
    assert loaded[-1] == 4 * BT, loaded
    assert torch.equal(out, _generate(model, base, DynamicCache(config=model.config)))


def test_blocks_saved_from_the_remote_keep_the_local_chains_head(model, tmp_path, redis_server):
    """Blocks read from Redis and saved locally evicted the local store's head of the same chain, leaving a tail
    that no lookup reaches: a worker without the server then loaded nothing."""
    capacity = 3 * _record_bytes(model, tmp_path)
    ids, _ = prompt(1, 40, seed=1)
    directory = tmp_path / "kv"
    for _ in range(3):
        with _cache(model, directory, capacity, remote=redis_server.url) as cache:
            cache.load_prefix(model, ids)
            _generate(model, ids, cache)
            cache.flush()
    redis_server.stop()
    with _cache(model, directory, capacity) as cache:
        assert cache.load_prefix(model, ids) == 3 * BT


def test_a_full_store_warns_once_per_directory_in_a_process(model, tmp_path, caplog):
    capacity = 2 * _record_bytes(model, tmp_path)
    directory = tmp_path / "kv"
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        for seed in range(3):
            ids, _ = prompt(1, 40, seed=10 + seed)
            with _cache(model, directory, capacity) as cache:
                cache.load_prefix(model, ids)
                _generate(model, ids, cache)
                cache.flush()
    dropped = [r for r in caplog.records if "does not fit in persist_gb" in r.getMessage()]
    assert len(dropped) >= 3  # every cache dropped blocks ...
    assert [r.levelno for r in dropped].count(logging.WARNING) == 1  # ... and one warning says so


def test_records_that_the_capacity_cannot_keep_are_not_written(tmp_path, monkeypatch):
    """A put of more than the capacity holds wrote and fsynced every record, then deleted those it could not list:
    a busy server with a small ``persist_gb`` wrote its disk for nothing on every request."""
    from tierkv import safefs

    items = [_item(f"{n:032x}", n, parent=f"{n - 1:032x}" if n else None) for n in range(6)]
    size = len(items[0].head) + len(items[0].payload)
    store = PersistentStore(tmp_path, 2 * size + size // 2)
    written: list[int] = []
    write_all = safefs.write_all
    monkeypatch.setattr(safefs, "write_all", lambda fd, parts: (written.append(sum(map(len, parts))),
                                                                  write_all(fd, parts))[1])
    try:
        assert store.put(items) == 2
        assert written.count(size) == 2  # the two records that fit, and no other (besides the manifest)
        assert store.lookup([item.key for item in items]) == 2
    finally:
        store.close()
