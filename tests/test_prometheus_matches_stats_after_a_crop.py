"""Every Prometheus family carries the very ``stats()`` figure its table row names, checked on a streaming cache
whose figures differ from each other: a crop made a prefetched chunk stale (one miss beside many hits) and freed
blocks (allocation below its peak)."""

from __future__ import annotations

import pytest
import torch
from models import prompt, tiny_model
from prometheus_client.parser import text_string_to_metric_families

import tierkv.metrics
from tierkv import TieredCache


def _samples(cache) -> dict[tuple[str, tuple], float]:
    text = tierkv.metrics.exposition(cache).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_family_is_its_stats_figure(tmp_path):
    model = tiny_model("llama", layers=2)
    ids, _ = prompt(1, 30, seed=7)
    with TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            torch.no_grad():
        with cache.streaming(model, chunk_tokens=16):
            logits = model(ids, past_key_values=cache).logits[:, -1]
            for step in range(6):
                token = logits.argmax(-1, keepdim=True)
                if step == 3:
                    cache.crop(-20)  # blocks freed; the chunk fetched ahead for layer 0 is stale
                logits = model(token, past_key_values=cache).logits[:, -1]
        stats = cache.stats()
        samples = _samples(cache)
    assert stats["prefetch_misses"] >= 1 and stats["prefetch_hits"] > stats["prefetch_misses"]
    assert any(stats["peak_bytes_allocated"][t] > stats["bytes_allocated"][t] for t in stats["bytes_allocated"])
    for family, key in (("allocated_bytes", "bytes_allocated"), ("peak_allocated_bytes", "peak_bytes_allocated"),
                        ("budget_bytes", "budget_bytes"), ("resident_bytes", "bytes_resident"),
                        ("blocks", "blocks")):
        for tier, value in stats[key].items():
            assert samples[(f"tierkv_{family}", (("tier", tier),))] == value, (family, tier)
    for family, key in (("prefetch_hits_total", "prefetch_hits"), ("prefetch_misses_total", "prefetch_misses"),
                        ("disk_read_ahead_hits_total", "disk_read_ahead_hits"), ("tokens", "tokens"),
                        ("state_bytes", "state_bytes"), ("prefetch_depth", "prefetch_depth"),
                        ("staging_bytes", "bytes_staging")):
        assert samples[(f"tierkv_{family}", ())] == stats[key], family
    assert samples[("tierkv_prefetch_stall_seconds_total", ())] == pytest.approx(stats["prefetch_stall_s"])
    assert samples[("tierkv_writeback_pending_blocks", ())] == stats["writeback"]["pending_blocks"]
    assert samples[("tierkv_decode_step_seconds", ())] == pytest.approx(stats["steps"]["median"]["wall_s"])
