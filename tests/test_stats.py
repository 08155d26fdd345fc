"""Telemetry (``stats()["steps"]``), the bounded step history, profile resolution and the timeline trace.

No timed assertions: times are only checked to be present, finite and consistent with each other.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from models import tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.bandwidth import PRESETS, Link, LinkProfile, predict_step
from tierkv.errors import InvalidConfigError
from tierkv.stats import (
    HISTORY,
    LayerRecord,
    ReadTiming,
    Timeline,
    Trace,
    default_profile,
    make_trace,
    resolve_profile,
    steady_state_placement,
)
from tierkv.vocabulary import READ_LINKS

NEW_TOKENS = 8


def _generate(tmp_path, **cache_kwargs):
    model = tiny_model("llama", layers=3)
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=DynamicCache())
    device = TieredCache.min_device_bytes(model.config, 40 + NEW_TOKENS, block_tokens=4) + 4 * 4096
    kwargs = dict(gpu_gb=f"{device}B", cpu_gb="16KiB", disk_dir=tmp_path / "disk", block_tokens=4)
    cache = TieredCache(**{**kwargs, **cache_kwargs})
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)  # telemetry and tracing never change the result
    return cache


def test_step_telemetry_keys_and_sanity(tmp_path):
    cache = _generate(tmp_path)
    stats = cache.stats()
    steps = stats["steps"]
    # NEW_TOKENS - 1 decode passes; the last one is still open (a step closes when the next one starts)
    assert steps["kind"] == "decode" and steps["count"] == NEW_TOKENS - 2
    assert steps["window"] == HISTORY and steps["profile"].startswith("presets")
    median, last = steps["median"], steps["last"]
    for key in ("wall_s", "compute_s", "stall_s", "sync_read_s", "transfer_s", "predicted_transfer_s",
                "predicted_step_s", "transfer_s_by_link", "predicted_transfer_s_by_link", "bytes_by_link"):
        assert key in median and key in last
    assert last["new_tokens"] == 1 and last["context"] == 40 + NEW_TOKENS - 2
    assert 0 < last["compute_s"] <= last["wall_s"] and math.isfinite(last["wall_s"])
    assert last["stall_s"] >= 0 and 0 <= last["sync_read_s"] <= last["transfer_s"]
    assert set(last["transfer_s_by_link"]) <= set(READ_LINKS)
    assert set(last["bytes_by_link"]) == set(last["predicted_transfer_s_by_link"])
    # blocks really live on all three tiers, and every decode step reads all of them
    assert stats["blocks"]["host"] > 0 and stats["blocks"]["disk"] > 0
    assert {"device->device", "host->device", "disk->device"} <= set(last["bytes_by_link"])
    token_bytes = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, fp32
    assert sum(last["bytes_by_link"].values()) >= 3 * last["context"] * token_bytes
    assert all(v > 0 for v in last["predicted_transfer_s_by_link"].values())
    assert last["predicted_step_s"] > 0
    # the telemetry's reads are part of what the store counted
    history = cache.executor.timeline.completed()
    for link in READ_LINKS:
        assert sum(step.bytes.get(link, 0) for step in history) <= stats["bytes_moved"][link]
    assert stats["prefetch_depth"] == 1 and stats["prefetch_auto"] == []
    cache.close()


def test_predicted_transfer_uses_the_profile(tmp_path):
    slow = LinkProfile({key: Link(key, 1e6, 0.0) for key in
                        ("host->device", "device->device", "disk->host", "device->host", "host->disk")})
    path = tmp_path / "profile.json"
    slow.save(path)
    cache = _generate(tmp_path, profile=path)
    last = cache.stats()["steps"]["last"]
    assert cache.stats()["steps"]["profile"] == f"profile={path}"
    nbytes = last["bytes_by_link"]
    predicted = last["predicted_transfer_s_by_link"]
    assert predicted["host->device"] == pytest.approx(nbytes["host->device"] / 1e6)
    assert predicted["disk->device"] == pytest.approx(2 * nbytes["disk->device"] / 1e6)  # disk->host, host->device
    cache.close()


def test_history_is_bounded_and_summarised():
    timeline = Timeline(default_profile("cpu"), "test", history=HISTORY)
    now = 0.0
    for step in range(HISTORY + 44):
        timeline.begin_step(now, 1 if step else 40, 40 + step, 1)
        for layer in range(2):
            timeline.add_reads(layer, [ReadTiming("host->device", 1000, 2, now, now + 0.001)], sync=False)
            timeline.add_compute(layer, 0.004)
        now += 0.01
    timeline.begin_step(now, 1, 0, 1)  # closes the last full step
    assert len(timeline.history) == HISTORY
    summary = timeline.summary()  # runs the model over the kept steps, then keeps per-layer detail of two only
    assert sum(step.layers is not None for step in timeline.history) == 2
    assert summary["count"] == HISTORY and summary["kind"] == "decode"
    assert summary["median"]["wall_s"] == pytest.approx(0.01)
    assert summary["median"]["compute_s"] == pytest.approx(0.008)
    assert summary["median"]["transfer_s_by_link"]["host->device"] == pytest.approx(0.002)
    assert summary["median"]["bytes_by_link"]["host->device"] == 2000


def test_steady_state_placement_overlaps_layer_zero_with_the_last_layer():
    layers = [LayerRecord(0.01, {"host->device": 10**6}, {"host->device": 1}) for _ in range(4)]
    placement = steady_state_placement(layers)
    assert len(placement.layers) == 5
    assert placement.layers[0].compute_s == 0.01 and placement.layers[0].host_bytes == 0
    assert placement.layers[-1].compute_s == 0.0 and placement.layers[-1].host_bytes == 10**6
    profile = LinkProfile({"host->device": Link("h", 1e8, 0.0)})  # 10 ms per layer: exactly hidden
    assert predict_step(placement, profile, 1).step_s == pytest.approx(0.04)
    assert predict_step(placement, profile, 0).step_s == pytest.approx(0.08)


def test_profile_resolution(tmp_path, monkeypatch):
    given = LinkProfile({"host->device": PRESETS["pcie5"]})
    assert resolve_profile(given, "cuda") == (given, "profile= (LinkProfile)")
    path = tmp_path / "p.json"
    given.save(path)
    monkeypatch.setenv("TIERKV_PROFILE", str(path))
    profile, source = resolve_profile(None, "cpu")
    assert source == f"TIERKV_PROFILE={path}" and profile.links["host->device"] == PRESETS["pcie5"]
    monkeypatch.delenv("TIERKV_PROFILE")
    assert resolve_profile(None, "cpu")[0].links["host->device"] == PRESETS["dram"]
    assert resolve_profile(None, "cuda", 9)[0].links["host->device"] == PRESETS["pcie5"]
    assert resolve_profile(None, "cuda", 8)[0].links["host->device"] == PRESETS["pcie4"]
    with pytest.raises(InvalidConfigError, match="does not exist"):
        resolve_profile(tmp_path / "missing.json", "cpu")


def test_trace_is_valid_chrome_json_with_mover_spans(tmp_path):
    cache = _generate(tmp_path, trace=True)
    path = tmp_path / "trace.json"
    cache.save_trace(path)
    data = json.loads(path.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert spans
    for event in spans:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(event)
        assert event["dur"] >= 0 and event["ts"] >= 0
    threads = {e["tid"]: e["args"]["name"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    mover = [e for e in spans if threads.get(e["tid"], "").startswith("tierkv-mover")]
    assert mover and all(e["cat"] == "prefetch" and "->device L" in e["name"] for e in mover)
    assert {"host->device", "disk->device"} <= {e["name"].split(" ")[0] for e in mover}
    assert any(e["cat"] == "compute" for e in spans)
    assert {e["tid"] for e in spans if e["cat"] == "compute"}.isdisjoint({e["tid"] for e in mover})
    cache.close()


def test_trace_path_from_environment_is_written_at_close(tmp_path, monkeypatch):
    path = tmp_path / "env-trace.json"
    monkeypatch.setenv("TIERKV_TRACE", str(path))
    cache = _generate(tmp_path)
    assert cache.trace is not None and not path.exists()
    cache.close()
    assert json.loads(path.read_text())["traceEvents"]
    assert make_trace(False) is None  # explicit off wins over the environment


def test_trace_off_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TIERKV_TRACE", raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a span was recorded with the trace off")

    monkeypatch.setattr(Trace, "span", refuse)
    cache = _generate(tmp_path)
    assert cache.trace is None and cache.executor.trace is None
    with pytest.raises(InvalidConfigError, match="trace=True"):
        cache.save_trace(tmp_path / "x.json")
    cache.close()


def test_the_telemetry_of_long_streaming_steps_stays_bounded():
    """Regression: streaming records one stage per chunk, and the steps not yet read kept them all (the last
    256 steps'): 36K records at 1,200 steps of a tiny model, ~1 GB at 1M tokens of an 8B one. Past
    ``HELD_RECORDS`` the oldest are run through the bandwidth model as they close, which drops their detail."""
    from tierkv.stats import HELD_RECORDS, Timeline

    timeline = Timeline(LinkProfile.from_presets("pcie4", "nvme-gen4"), "preset")
    stages = 500  # a long context's chunks
    for step in range(100):
        timeline.begin_step(float(step), 1, 1000, 1)
        for stage in range(stages):
            timeline.layer(stage).bytes["host->device"] = 1 << 20
            timeline.add_compute(stage, 1e-4)
    timeline.end_step(100.0)
    held = sum(len(step.layers or ()) for step in timeline.history)
    assert held <= HELD_RECORDS + 2 * stages
    summary = timeline.summary()
    assert summary and all(step.predicted_step_s > 0 for step in timeline.history)
