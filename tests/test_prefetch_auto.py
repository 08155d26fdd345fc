"""``prefetch_depth="auto"``: the depth comes from the bandwidth model on the measured decode step.

Unit tests drive :func:`tierkv.stats.choose_prefetch_depth` with synthetic steps; the integration tests run a
tiny model with link profiles that make compute dominate (fast links) or transfers dominate (a host->device
link calibrated from the run's own measured compute so that one layer's transfer takes ~2x its compute).
No timed assertions: decisions are checked against the model's own predictions.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.bandwidth import Link, LinkProfile, min_prefetch_depth
from tierkv.errors import InvalidConfigError
from tierkv.stats import LayerRecord, choose_prefetch_depth, steady_state_placement

MB = 10**6
LINKS = ("host->device", "device->host", "device->device", "disk->host", "host->disk", "host->host")


def profile(bandwidth: dict[str, float]) -> LinkProfile:
    return LinkProfile({key: Link(key, bandwidth.get(key, 1e15), 0.0) for key in LINKS})


def layers(n: int, compute_s: float, **nbytes: int) -> list[LayerRecord]:
    data = {link.replace("_", "->"): value for link, value in nbytes.items()}
    return [LayerRecord(compute_s, dict(data), dict.fromkeys(data, 1)) for _ in range(n)]


def choose(records, links, *, held=2, free=0, max_buffers=16, host_free=10**12, current=1, buffer=MB, read_ahead=0):
    """Without the disk read-ahead by default: the depth logic on its own (the read-ahead test is below)."""
    return choose_prefetch_depth(records, links, current=current, held_buffers=held, buffer_bytes=buffer,
                                 free_device_bytes=free, max_buffers=max_buffers, free_host_bytes=host_free,
                                 read_ahead=read_ahead)


def test_compute_dominates_needs_no_prefetch():
    records = layers(8, 0.01, host_device=MB, device_device=MB)
    choice = choose(records, profile({"host->device": 1e12}), free=10 * MB)
    assert choice.depth == 0 and choice.reason == "min_prefetch_depth"


def test_transfer_of_a_layer_longer_than_its_compute_needs_layer_ahead():
    records = layers(8, 0.01, host_device=MB)
    links = profile({"host->device": MB / 0.02})  # 20 ms per layer vs 10 ms of compute
    choice = choose(records, links, free=10 * MB)
    assert choice.depth == 1
    assert choice.depth == min_prefetch_depth(steady_state_placement(records), links, max_depth=choice.free_depth)


def test_disk_then_pcie_needs_two_layers_ahead():
    # each stage alone (8 ms) hides behind 10 ms of compute, both in sequence (16 ms) do not
    records = layers(8, 0.01, disk_device=MB)
    links = profile({"disk->host": MB / 0.008, "host->device": MB / 0.008})
    choice = choose(records, links, free=10 * MB)
    assert choice.depth == 2 and choice.predicted_step_s[2] < choice.predicted_step_s[1]


def test_disk_read_ahead_makes_the_second_layer_of_staging_unnecessary():
    """The executors submit disk reads layers ahead on the engine's threads: the disk stage no longer waits
    for a staging buffer, so layer-ahead prefetch already hides both stages."""
    records = layers(8, 0.01, disk_device=MB)
    links = profile({"disk->host": MB / 0.008, "host->device": MB / 0.008})
    choice = choose(records, links, free=10 * MB, read_ahead=4)
    assert choice.depth == 1 and choice.predicted_step_s[1] == pytest.approx(choice.predicted_step_s[2])


def test_depth_is_bounded_by_the_device_budget():
    records = layers(8, 0.01, disk_device=MB, device_device=4 * MB)
    fast_host = profile({"disk->host": MB / 0.008, "host->device": MB / 0.008})
    # no free room: a third buffer (one layer's K/V, 5 MB) must evacuate device KV; the evacuated bytes
    # (625 KB more per layer over host->device) cost more than the deeper prefetch saves
    kept = choose(records, fast_host, free=0, buffer=5 * MB)
    assert kept.free_depth == 1 and kept.depth == 1
    # with nothing on the device to evacuate the third buffer is free of that cost and pays off
    nothing_resident = layers(8, 0.01, disk_device=MB)
    deeper = choose(nothing_resident, fast_host, free=0, buffer=5 * MB)
    assert deeper.depth == 2 and deeper.reason.startswith("deeper staging")
    # the budget holds two buffers at most: depth 1 whatever the model would like
    assert choose(nothing_resident, fast_host, free=0, max_buffers=2).depth == 1


def test_missing_link_keeps_the_current_depth():
    records = layers(4, 0.01, disk_device=MB)
    choice = choose(records, LinkProfile({"host->device": Link("h", 1e9, 0.0)}), current=1)
    assert choice.depth == 1 and choice.reason.startswith("kept")


def test_invalid_depth_is_refused():
    with pytest.raises(InvalidConfigError, match="'auto'"):
        TieredCache(prefetch_depth="deep")


# ------------------------------------------------------------------------------------ integration
def _run(tmp_path, links: LinkProfile | None, prefetch_depth, new_tokens: int = 8):
    model = tiny_model("llama", layers=4)
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=DynamicCache())
    # room for the staging of a deep prefetch, but most KV on the host: every layer moves host bytes
    device = TieredCache.min_device_bytes(model.config, 48 + new_tokens, block_tokens=4, prefetch_depth=3)
    cache = TieredCache(gpu_gb=f"{device}B", cpu_gb="1MB", block_tokens=4, prefetch_depth=prefetch_depth,
                        profile=links)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)  # whatever depth auto picks, the result is exact
    return cache


def _check_choice(cache) -> dict:
    choices = cache.stats()["prefetch_auto"]
    assert len(choices) == 1
    choice = choices[0]
    predicted = choice["predicted_step_s"]
    shallow = [d for d in predicted if d <= choice["free_depth"]]
    best = min(predicted[d] for d in shallow)
    # the choice is min_prefetch_depth's rule: the shallowest depth within 1 % of the best reachable one
    assert choice["depth"] == min(d for d in shallow if predicted[d] <= best * 1.01) or \
        choice["reason"].startswith("deeper")
    assert cache.stats()["prefetch_depth"] == choice["depth"]
    assert len(cache.executor.buffers) == choice["depth"] + 1
    return choice


def test_auto_with_fast_links_drops_prefetch(tmp_path):
    cache = _run(tmp_path, profile({}), "auto")
    choice = _check_choice(cache)
    assert choice["previous"] == 1 and choice["depth"] == 0
    cache.close()


def test_auto_with_slow_host_link_prefetches(tmp_path):
    # calibrate: measure the decode step at depth 1, then make the host->device link so slow that one
    # layer's host bytes take twice its measured compute
    probe = _run(tmp_path, profile({}), 1)
    records = probe.executor.timeline.last_decode_layers()
    host = sum(r.bytes.get("host->device", 0) for r in records) / len(records)
    compute = sum(r.compute_s for r in records) / len(records)
    probe.close()
    assert host > 0 and compute > 0
    cache = _run(tmp_path, profile({"host->device": host / (2 * compute)}), "auto")
    choice = _check_choice(cache)
    assert choice["depth"] >= 1
    cache.close()
