"""``cache.stats()`` as a typed structure (:class:`tierkv.stats.CacheStats`) and as Prometheus metrics
(:mod:`tierkv.metrics`), checked on a real cache that used all three tiers."""

from __future__ import annotations

import typing

import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError
from tierkv.stats import CacheStats, WritebackStats, empty_stats


@pytest.fixture(scope="module")
def used_cache(tmp_path_factory):
    """A cache after a 256-token prefill and 3 decode steps of a tiny Llama, budgets small enough for disk."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config).eval()
    kv = TieredCache.kv_bytes_per_token(config, torch.float32) * 260
    gpu = TieredCache.min_device_bytes(config, 260, block_tokens=16) + kv // 8
    cache = TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{kv // 4}B", disk_dir=str(tmp_path_factory.mktemp("disk")),
                        block_tokens=16, config=config)
    with torch.inference_mode():
        model.generate(torch.randint(0, 128, (1, 256)), cache=cache, max_new_tokens=4, do_sample=False)
    yield cache
    cache.close()


def test_stats_of_a_used_cache_match_the_typed_structure(used_cache):
    stats = used_cache.stats()
    hints = typing.get_type_hints(CacheStats)
    assert set(stats) <= set(hints), set(stats) - set(hints)  # every key is declared (with its unit in the name)
    assert CacheStats.__required_keys__ <= set(stats)
    assert set(stats["writeback"]) == set(typing.get_type_hints(WritebackStats))
    assert all(stats["bytes_resident"][tier] > 0 for tier in ("device", "host", "disk"))


def test_empty_stats_has_the_same_required_keys():
    assert set(empty_stats()) == CacheStats.__required_keys__


def _scrape(cache, **labels) -> dict[tuple[str, tuple], float]:
    import tierkv.metrics

    text = tierkv.metrics.exposition(cache, **labels).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_prometheus_exposition_carries_the_same_counters(used_cache):
    stats = used_cache.stats()
    samples = _scrape(used_cache, model="tiny")
    label = (("model", "tiny"),)
    assert samples[("tierkv_tokens", label)] == stats["tokens"] == 259
    for tier, nbytes in stats["bytes_resident"].items():
        assert samples[("tierkv_resident_bytes", tuple(sorted((*label, ("tier", tier)))))] == nbytes
        assert samples[("tierkv_blocks", tuple(sorted((*label, ("tier", tier)))))] == stats["blocks"][tier]
    for link, nbytes in stats["bytes_moved"].items():
        assert samples[("tierkv_moved_bytes_total", tuple(sorted((*label, ("link", link)))))] == nbytes
    assert samples[("tierkv_prefetch_hits_total", label)] == stats["prefetch_hits"]
    assert samples[("tierkv_prefetch_stall_seconds_total", label)] == pytest.approx(stats["prefetch_stall_s"])
    assert samples[("tierkv_staging_bytes", label)] == stats["bytes_staging"]


def test_register_reads_stats_at_each_scrape(used_cache):
    import tierkv.metrics

    calls = []

    class Counting:
        def stats(self):
            calls.append(1)
            return used_cache.stats()

    registry = CollectorRegistry()
    counting = Counting()  # the registry holds what it scrapes weakly: the caller keeps it
    tierkv.metrics.register(counting, registry, model="tiny")
    assert calls == []  # nothing is read until a scrape
    assert registry.get_sample_value("tierkv_tokens", {"model": "tiny"}) == 259 and calls


def test_reserved_label_names_are_refused(used_cache):
    import tierkv.metrics

    with pytest.raises(InvalidConfigError, match="'tier' is reserved"):
        tierkv.metrics.exposition(used_cache, tier="x")


def test_a_scrape_beside_a_thread_that_decodes_never_fails():
    """Regression: ``stats()`` read the block table without the cache's lock, so a metrics scrape (the HTTP
    server's thread) while another thread's forward added layers (a prefill after ``reset()``) failed with
    "dictionary changed size during iteration". It is taken under the lock now."""
    import threading

    import tierkv.metrics

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=24,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(2, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    cache = TieredCache(gpu_gb="64MiB", cpu_gb="64MiB", block_tokens=16)  # no config: layers come as they are used
    done = threading.Event()

    def requests() -> None:
        try:
            for _ in range(6):
                cache.reset()
                model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False)
        finally:
            done.set()

    worker = threading.Thread(target=requests)
    worker.start()
    scrapes = 0
    try:
        while not done.is_set():
            tierkv.metrics.exposition(cache, model="tiny")
            scrapes += 1
    finally:
        worker.join()
        cache.close()
    assert scrapes > 0
