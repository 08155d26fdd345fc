"""Observability that stays truthful over a cache's life: several caches in one Prometheus registry, closed caches
leaving it, counters that never go back, every executor's decode steps in ``stats()["steps"]``, the prefetch depth
in use, the sparse device bytes by name, one trace file per cache, and the documented ``stats()`` keys."""

from __future__ import annotations

import gc
import json
import logging
import re
import weakref
from pathlib import Path

import pytest
import torch
from models import prompt, tiny_model
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

import tierkv.metrics
from tierkv import TieredCache, stats
from tierkv.errors import InvalidConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _cache(**kwargs) -> TieredCache:
    return TieredCache(gpu_gb="64MB", cpu_gb="64MB", block_tokens=16, config=tiny_model("llama").config, **kwargs)


def _prefill(cache: TieredCache, tokens: int = 40) -> None:
    ids, mask = prompt(1, tokens)
    with torch.no_grad():
        tiny_model("llama")(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)


def _decode(cache: TieredCache, steps: int) -> None:
    with torch.no_grad():
        for _ in range(steps):
            tiny_model("llama")(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)


def _families(registry: CollectorRegistry) -> list:
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


# ------------------------------------------------------------------------------------- 1. one registry
def test_several_caches_share_a_registry_each_family_once():
    registry = CollectorRegistry()
    a, b = _cache(), _cache()
    try:
        _prefill(a, 40)
        _prefill(b, 24)
        tierkv.metrics.register(a, registry, model="a")
        tierkv.metrics.register(b, registry, model="b")
        families = _families(registry)
        names = [family.name for family in families]
        assert len(names) == len(set(names)), names  # each family once: a valid exposition
        tokens = {s.labels["model"]: s.value for f in families if f.name == "tierkv_tokens" for s in f.samples}
        assert tokens == {"a": 40, "b": 24}
        moved = next(f for f in families if f.name == "tierkv_moved_bytes")
        assert {s.labels["model"] for s in moved.samples} == {"a", "b"}
        with pytest.raises(InvalidConfigError, match="registered already"):
            tierkv.metrics.register(b, registry, model="a")  # its series would collide with a's
    finally:
        a.close()
        b.close()


def test_the_default_registry_takes_several_caches():
    a, b = _cache(), _cache()
    try:
        tierkv.metrics.register(a, model="default-a")
        tierkv.metrics.register(b, model="default-b")  # was: ValueError: Duplicated timeseries
        assert REGISTRY.get_sample_value("tierkv_tokens", {"model": "default-b"}) == 0
    finally:
        a.close()
        b.close()
    assert REGISTRY.get_sample_value("tierkv_tokens", {"model": "default-a"}) is None  # closed: dropped


# ------------------------------------------------------------------------------------- 2. closed caches
def test_closed_caches_leave_the_registry():
    registry = CollectorRegistry()
    sizes = []
    refs = []
    for i in range(50):
        cache = _cache(trace=False)
        _prefill(cache, 8)
        tierkv.metrics.register(cache, registry, request=str(i))
        refs.append(weakref.ref(cache))
        cache.close()
        del cache
        sizes.append(len(generate_latest(registry)))
    gc.collect()
    assert not any(ref() is not None for ref in refs)  # the registry holds no cache alive
    assert max(sizes) == min(sizes) == 0  # a closed cache's series end: the output does not grow
    live = _cache()
    tierkv.metrics.register(live, registry, request="live")
    try:
        assert {s.labels["request"] for f in _families(registry) for s in f.samples} == {"live"}
    finally:
        live.close()


# ------------------------------------------------------------------------------------- 3. monotonic
def test_counters_never_go_back_over_rebuilds_and_close():
    model = tiny_model("llama")
    cache = _cache()
    ids, _ = prompt(1, 64)
    with torch.no_grad(), cache.streaming(model, chunk_tokens=16):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        _decode(cache, 2)
    before = cache.stats()
    assert before["prefetch_hits"] > 0
    with torch.no_grad(), cache.streaming(model, chunk_tokens=32):  # streaming rebuilt with other options
        _decode(cache, 1)
    rebuilt = cache.stats()
    assert rebuilt["prefetch_hits"] >= before["prefetch_hits"]
    assert rebuilt["prefetch_stall_s"] >= before["prefetch_stall_s"]
    cache.close()
    closed = cache.stats()
    assert closed["bytes_moved"] == rebuilt["bytes_moved"] != {}
    for key in ("prefetch_hits", "prefetch_misses", "prefetch_stall_s", "disk_read_ahead_hits"):
        assert closed[key] == rebuilt[key], key
    assert closed["bytes_resident"] == dict.fromkeys(("device", "host", "disk"), 0)  # nothing held any more


def test_sparse_counters_go_on_over_a_rebuild_and_stay_after_close():
    """``stats()["sparse"]`` counts every sparse step of the cache's life: a sparse block with other options
    (a rebuilt executor) adds to what the earlier one counted, and the figures stay readable after close."""
    model = tiny_model("llama")
    cache = _cache()
    ids, _ = prompt(1, 64)
    with torch.no_grad(), cache.sparse(model, tokens=32, chunk_tokens=16):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        _decode(cache, 3)
    first = cache.stats()["sparse"]
    assert first["steps"] == 3 and first["layer_steps"] > 0
    with torch.no_grad(), cache.sparse(model, tokens=48, chunk_tokens=16):  # other options: a new executor
        _decode(cache, 2)
    rebuilt = cache.stats()["sparse"]
    assert rebuilt["steps"] == 5
    for key in ("layer_steps", "blocks_selected", "blocks_total", "pages_selected", "bytes_fetched"):
        assert rebuilt[key] >= first[key], key
    assert rebuilt["blocks_total"] > first["blocks_total"]
    cache.close()
    closed = cache.stats()["sparse"]
    assert {k: v for k, v in closed.items() if not k.endswith("_device_bytes")} == \
        {k: v for k, v in rebuilt.items() if not k.endswith("_device_bytes")}


# ------------------------------------------------------------------------------------- 4. split's steps
def test_split_records_its_decode_steps():
    model = tiny_model("llama")
    cache = _cache()
    ids, _ = prompt(1, 64)
    try:
        with torch.no_grad(), cache.split(model, chunk_tokens=16):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            _decode(cache, 3)
        steps = cache.stats()["steps"]
        assert (steps["count"], steps["kind"]) == (3, "decode")
        assert steps["last"]["new_tokens"] == 1 and steps["last"]["context"] == 67
        registry = CollectorRegistry()
        tierkv.metrics.register(cache, registry)
        assert registry.get_sample_value("tierkv_decode_step_seconds") == steps["median"]["wall_s"]
    finally:
        cache.close()


# ------------------------------------------------------------------------------------- 5. prefetch depth
def test_prefetch_depth_is_0_while_prefetch_is_off(tmp_path, caplog):
    model = tiny_model("llama")
    batch, context = 2, 512
    need = TieredCache.min_device_bytes(model.config, context + 8, batch=batch, block_tokens=16, prefetch_depth=0)
    ids, mask = prompt(batch, context)
    with TieredCache(gpu_gb=f"{need}B", cpu_gb="256KB", disk_dir=str(tmp_path), block_tokens=16,
                     config=model.config) as cache, torch.no_grad(), caplog.at_level(logging.WARNING, "tierkv"):
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], 1)
        model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, past_key_values=cache, use_cache=True)
        assert "prefetch is off" in caplog.text
        assert cache.stats()["prefetch_depth"] == 0
        assert tierkv.metrics.exposition(cache).decode().count("tierkv_prefetch_depth 0.0") == 1


def test_prefetch_misses_help_says_what_is_counted():
    with _cache() as cache:
        _prefill(cache)
        family = next(f for f in text_string_to_metric_families(tierkv.metrics.exposition(cache).decode())
                      if f.name == "tierkv_prefetch_misses")
    assert "not used" in family.documentation and "no prefetch had started" not in family.documentation


# ------------------------------------------------------------------------------------- 6. sparse bytes
def test_bytes_summaries_counts_the_summaries_alone():
    model = tiny_model("llama")
    cache = _cache()
    ids, _ = prompt(1, 128)
    try:
        with torch.no_grad(), cache.sparse(model, tokens=0.25, chunk_tokens=32):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            _decode(cache, 2)
            stats = cache.stats()
            samples = {f.name: f.samples[0].value for f in
                       text_string_to_metric_families(tierkv.metrics.exposition(cache).decode()) if f.samples}
    finally:
        cache.close()
    sparse = stats["sparse"]
    assert sparse["rest_copy_device_bytes"] > 0  # the default keeps a low-bit copy of the rest
    assert stats["bytes_summaries"] == sparse["summaries_device_bytes"]
    assert stats["bytes_rest_copy"] == sparse["rest_copy_device_bytes"]
    assert samples["tierkv_summaries_bytes"] == stats["bytes_summaries"]
    assert samples["tierkv_rest_copy_bytes"] == stats["bytes_rest_copy"]


# ------------------------------------------------------------------------------------- 7. traces
def _events(path: Path) -> list[dict]:
    return [event for event in json.loads(path.read_text())["traceEvents"] if event["ph"] == "X"]


def test_every_cache_traced_by_the_setting_keeps_its_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "trace.json"
    monkeypatch.setenv("TIERKV_TRACE", str(path))
    stats.check_trace_setting()  # the CLI's check before a command: counts no cache
    a, b = _cache(), _cache()
    with caplog.at_level(logging.INFO, "tierkv"):
        c = _cache()
    _prefill(a, 40)
    _prefill(b, 8)
    a.close()
    b.close()
    c.close()
    for cache, written in ((a, path), (b, tmp_path / "trace-2.json")):  # (the mover may add spans until close)
        assert [(e["name"], e["ts"]) for e in _events(written)] == [(e["name"], e["ts"]) for e in cache.trace.events]
    assert a.trace.events and b.trace.events
    assert _events(tmp_path / "trace-3.json") == []
    assert caplog.text.count(str(tmp_path / "trace-3.json")) == 1


def test_a_cache_closed_before_any_forward_writes_an_empty_trace(tmp_path):
    path = tmp_path / "trace.json"
    _cache(trace=str(path)).close()
    assert _events(path) == []


# ------------------------------------------------------------------------------------- 8. docs
def _documented() -> str:
    text = DOCS.read_text()
    return text[text.index("## Statistics and telemetry"):text.index("**`prefetch_depth=\"auto\"`**")]


def test_the_documented_keys_are_those_stats_returns(tmp_path):
    model = tiny_model("llama")
    documented = _documented()
    names = set(re.findall(r"`([a-z_>\-]+)`", documented))
    gpu = TieredCache.min_split_device_bytes(model.config, block_tokens=16, chunk_tokens=32)
    ids, _ = prompt(1, 256)
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=str(tmp_path), block_tokens=16,
                     config=model.config) as cache:
        with torch.no_grad(), cache.split(model, chunk_tokens=32):  # split's disk share lands on the host
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            _decode(cache, 1)
        split = cache.stats()
    with _cache() as cache, torch.no_grad(), cache.sparse(model, tokens=0.25, chunk_tokens=32):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        _decode(cache, 1)
        sparse = cache.stats()
    assert "disk->host" in split["bytes_moved"]
    assert set(split) | set(sparse) <= names, (set(split) | set(sparse)) - names
    assert set(split["bytes_moved"]) <= names, set(split["bytes_moved"]) - names
    assert set(sparse["sparse"]) <= names, set(sparse["sparse"]) - names
    assert "remote" in names and "per pass" in documented
