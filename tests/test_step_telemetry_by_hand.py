"""Step telemetry fed hand-made reads and times: what the summary, the per-link counts and the prefetch-depth
forecast must come to, worked out by hand from the numbers fed in."""

from __future__ import annotations

import pytest

from tierkv.attention.sparse import SparseCounters
from tierkv.bandwidth import Link, LinkProfile
from tierkv.stats import LayerRecord, ReadTiming, Timeline, add_counts, choose_prefetch_depth, default_profile

MB = 10**6


def test_copies_per_link_count_each_reads_own_copies():
    """A read job of 3 copies counts 3, not 1 (copies are the unit the profile's per-transfer latency applies to)."""
    timeline = Timeline(default_profile("cpu"), "test")
    timeline.begin_step(0.0, 1, 64, 1)
    timeline.add_reads(0, [ReadTiming("host->device", 3000, 3, 0.0, 0.001)], sync=False)
    timeline.add_reads(1, [ReadTiming("host->device", 5000, 5, 0.0, 0.001),
                           ReadTiming("disk->device", 700, 2, 0.0, 0.001)], sync=True)
    timeline.end_step(0.01)
    (step,) = timeline.completed()
    row = step.as_dict()
    assert row["copies_by_link"] == {"host->device": 8, "disk->device": 2}
    assert row["bytes_by_link"] == {"host->device": 8000, "disk->device": 700}


def test_sync_read_time_counts_only_reads_on_the_compute_thread():
    """Prefetch reads (mover) are transfer time; only synchronous reads are also ``sync_read_s``."""
    timeline = Timeline(default_profile("cpu"), "test")
    timeline.begin_step(0.0, 1, 64, 1)
    timeline.add_reads(0, [ReadTiming("host->device", 100, 1, 1.0, 1.25)], sync=False)  # 0.25 s prefetch
    timeline.add_reads(1, [ReadTiming("host->device", 100, 1, 2.0, 2.5)], sync=True)  # 0.5 s synchronous
    timeline.end_step(3.0)
    (step,) = timeline.completed()
    assert step.sync_read_s == pytest.approx(0.5)
    assert step.transfer_s["host->device"] == pytest.approx(0.75)


def test_summary_is_the_median_of_the_decode_steps():
    """Three decode steps of 1, 2 and 9 s (and a prefill pass, left out): the median is 2 s, not the mean."""
    timeline = Timeline(default_profile("cpu"), "test")
    timeline.begin_step(0.0, 40, 40, 1)  # prefill pass: 100 s
    now = 100.0
    for wall in (1.0, 2.0, 9.0):
        timeline.begin_step(now, 1, 41, 1)
        timeline.add_compute(0, wall / 2)
        now += wall
    timeline.end_step(now)
    summary = timeline.summary()
    assert summary["count"] == 3 and summary["kind"] == "decode"
    assert summary["median"]["wall_s"] == pytest.approx(2.0)
    assert summary["median"]["compute_s"] == pytest.approx(1.0)
    assert summary["last"]["wall_s"] == pytest.approx(9.0)


def test_added_counters_sum_numbers_per_key_dicts_and_nested_counters():
    into = SparseCounters(steps=2, blocks_selected=10, link_bytes={"host->device": 100})
    into.speculation.hits = 1
    other = SparseCounters(steps=3, blocks_selected=5, link_bytes={"host->device": 50, "disk->device": 7})
    other.speculation.hits = 4
    add_counts(into, other)
    assert into.steps == 5 and into.blocks_selected == 15
    assert into.link_bytes == {"host->device": 150, "disk->device": 7}
    assert into.speculation.hits == 5


def test_evacuated_kv_goes_to_disk_once_the_host_is_full():
    """A depth deeper than the free device room evacuates device KV: to the host while it has room, then to disk.
    With the disk link slow, the same depth is forecast slower when the host has no room than when it has."""
    records = [LayerRecord(0.01, {"host->device": MB, "device->device": 4 * MB},
                           {"host->device": 1, "device->device": 1}) for _ in range(8)]
    links = LinkProfile({key: Link(key, bw, 0.0) for key, bw in (
        ("host->device", MB / 0.008), ("device->host", 1e15), ("device->device", 1e15),
        ("disk->host", MB / 0.5), ("host->disk", 1e15), ("host->host", 1e15))})

    def forecast(host_free: int) -> dict[int, float]:
        return choose_prefetch_depth(records, links, current=1, held_buffers=2, buffer_bytes=5 * MB,
                                     free_device_bytes=0, max_buffers=16, free_host_bytes=host_free,
                                     read_ahead=0).predicted_step_s

    roomy, full = forecast(10**12), forecast(0)
    assert roomy[1] == pytest.approx(full[1])  # within the free room nothing is evacuated
    assert full[2] > roomy[2] * 1.5  # evacuated to disk: each layer's share read back over the slow disk link
