"""Link model, calibration fit, profiles and the layer-ahead step-time model."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import bandwidth
from tierkv.bandwidth import (
    DIRECT_STAGES,
    DISK_READ_AHEAD,
    LINK_KEYS,
    MAX_SLOWDOWN,
    PRESETS,
    Bottleneck,
    Contention,
    HostAttention,
    LayerLoad,
    Link,
    LinkProfile,
    Placement,
    fit_link,
    min_prefetch_depth,
    predict_split_step,
    predict_step,
)
from tierkv.errors import InvalidConfigError

PROFILE = LinkProfile.from_presets("pcie4", "nvme-gen4")


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = Link("x", 10e9, 1e-5)
    assert link.transfer_time(10**9) == pytest.approx(0.1 + 1e-5)
    assert link.transfer_time(10**9, n_transfers=4) == pytest.approx(0.1 + 4e-5)
    assert link.transfer_time(0, 0) == 0.0


@pytest.mark.parametrize(
    "bad", [dict(bandwidth_bytes_per_s=0.0), dict(latency_s=-1.0), dict(latency_s=math.nan)]
)
def test_link_rejects_bad_parameters(bad):
    with pytest.raises(InvalidConfigError):
        Link(**{"name": "x", "bandwidth_bytes_per_s": 1e9, "latency_s": 1e-6, **bad})


def test_fit_link_recovers_known_parameters():
    sizes = [2**k for k in range(12, 28, 2)]
    times = [20e-6 + s / 25e9 for s in sizes]
    link = fit_link("pcie", sizes, times)
    assert link.bandwidth_bytes_per_s == pytest.approx(25e9, rel=1e-9)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6)


def test_fit_link_clamps_negative_latency_to_zero():
    sizes = [10**6, 10**7, 10**8]
    times = [s / 1e10 for s in sizes]
    times[0] *= 0.5  # noise that tilts the unconstrained intercept below zero
    link = fit_link("noisy", sizes, times)
    assert link.latency_s == 0.0
    assert 0.9e10 < link.bandwidth_bytes_per_s < 1.1e10



def test_fit_link_survives_one_sample_slowed_by_a_busy_host():
    """``tierkv bench --quick`` on a loaded host: one small transfer's median, slowed 200x (its thread was
    descheduled for tens of milliseconds), tilts the least-squares slope below zero; the link must still be
    fitted, close to the truth, not dropped from the profile."""
    sizes = [4096 * 4**k for k in range(6)]  # 4 KiB .. 4 MiB, the quick bench's sizes
    times = [5e-6 + s / 8e9 for s in sizes]
    times[3] *= 200  # the 256 KiB sample
    link = fit_link("host->host", sizes, times)
    assert 7e9 < link.bandwidth_bytes_per_s < 9e9
    assert 0 <= link.latency_s < 1e-4

@pytest.mark.parametrize(
    ("sizes", "times", "needle"),
    [
        ([1, 2], [1.0], "one time per size"),
        ([4096, 4096], [1e-5, 2e-5], "distinct sizes"),
        ([4096, 8192], [1e-5, 0.0], "> 0"),
        ([4096, 8192], [2e-5, 1e-5], "does not grow"),
    ],
)
def test_fit_link_rejects_bad_input_with_a_fix(sizes, times, needle):
    with pytest.raises(InvalidConfigError, match=needle):
        fit_link("x", sizes, times)


def test_presets_are_sane():
    gb = 1e9
    assert 20 * gb <= PRESETS["pcie4"].bandwidth_bytes_per_s < 32 * gb  # below the 31.5 GB/s raw rate
    assert 40 * gb <= PRESETS["pcie5"].bandwidth_bytes_per_s < 64 * gb
    assert PRESETS["nvme-gen4"].bandwidth_bytes_per_s == pytest.approx(7 * gb)
    assert PRESETS["nvme-gen5"].bandwidth_bytes_per_s == pytest.approx(14 * gb)
    assert PRESETS["dram"].bandwidth_bytes_per_s == pytest.approx(20 * gb)
    assert all(link.latency_s < 1e-3 for link in PRESETS.values())
    assert set(PROFILE.links) == set(LINK_KEYS)


def test_from_presets_rejects_unknown_names():
    with pytest.raises(InvalidConfigError, match="pcie4, pcie5"):
        LinkProfile.from_presets("pcie9")
    with pytest.raises(InvalidConfigError, match="nvme-gen4, nvme-gen5"):
        LinkProfile.from_presets(disk="floppy")


def test_profile_save_load_round_trip(tmp_path):
    profile = LinkProfile(
        {"host->device": Link("measured", 23.7e9, 8e-6), "disk->host": Link("nvme", 3.1e9, 9e-5)},
        {"cpu": "test", "date": "today"},
    )
    path = tmp_path / "profile.json"
    profile.save(path)
    assert LinkProfile.load(path) == profile
    cpu_host = profile.replace(**{"host->host": PRESETS["dram"]})
    cpu_host = LinkProfile(cpu_host.links, cpu_host.machine, serial_mover=True,
                           contention=Contention(1.3, 1.1, 1.2, 1.05), layer_overhead_s=3e-4)
    cpu_host.save(path)
    assert LinkProfile.load(path) == cpu_host
    old = json.loads(path.read_text())
    old["contention"] = 1.3  # a profile written when contention was one processor-sharing factor
    path.write_text(json.dumps(old))
    assert LinkProfile.load(path).contention == Contention.uniform(1.3)


def test_profile_errors_name_the_fix(tmp_path):
    with pytest.raises(InvalidConfigError, match="tierkv bench"):
        LinkProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"links": {"host->device": {"name": "x"}}}')
    with pytest.raises(InvalidConfigError, match="malformed"):
        LinkProfile.load(tmp_path / "bad.json")
    with pytest.raises(InvalidConfigError, match="valid keys"):
        LinkProfile({"gpu->moon": PRESETS["pcie4"]})
    with pytest.raises(InvalidConfigError, match="tierkv bench"):
        LinkProfile({}).link("host->device")
    partial = LinkProfile.from_presets()
    del partial.links["device->device"]
    partial.save(tmp_path / "partial.json")
    with pytest.raises(InvalidConfigError, match=r"profile '.*partial\.json' has no 'device->device' link"):
        LinkProfile.load(tmp_path / "partial.json").link("device->device")
    with pytest.raises(InvalidConfigError, match=r"compute_by_copies=0.5 must be a slowdown in \[1, 4\]"):
        Contention(compute_by_copies=0.5)
    with pytest.raises(InvalidConfigError, match="layer_overhead_s=-1 must be a finite number of seconds"):
        LinkProfile({}, layer_overhead_s=-1)
    with pytest.raises(InvalidConfigError, match="must be a Contention"):
        LinkProfile({}, serial_mover=True, contention=1.3)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda d: d["links"]["host->device"].update(bandwidth_bytes_per_s=1e-300), "bandwidth_bytes_per_s=1e-300 is "
                                                                                 "outside"),
    (lambda d: d["links"]["disk->host"].update(bandwidth_bytes_per_s=1e300), "bandwidth_bytes_per_s=1e+300"),
    (lambda d: d["links"]["host->device"].update(latency_s=1e9), "latency_s=1000000000.0 is above 60 s"),
    (lambda d: d.update(host_attention={"bandwidth_bytes_per_s": 1e-300, "single_thread_bytes_per_s": 1e9,
                                        "threads": 2}), "host_attention.bandwidth_bytes_per_s=1e-300"),
    (lambda d: d.update(host_attention={"bandwidth_bytes_per_s": 1e9, "single_thread_bytes_per_s": 1e9,
                                        "threads": 10**12}), "threads=1000000000000 is above"),
    (lambda d: d.update(layer_overhead_s=1e300), "layer_overhead_s=1e+300 is above"),
])
def test_a_profile_file_claiming_rates_no_machine_has_is_refused(tmp_path, edit, says):
    """A profile is a file anyone may hand over: a host-kernel rate of 1e-300 B/s predicted an infinite step
    (0 tokens/s), a link's 1e-300 failed deep in the planner; refused when the file is read, naming the number."""
    profile = LinkProfile({"host->device": Link("pcie", 23.7e9, 8e-6), "disk->host": Link("nvme", 3.1e9, 9e-5)})
    path = tmp_path / "profile.json"
    profile.save(path)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidConfigError, match=f"malformed .*{re.escape(says)}"):
        LinkProfile.load(path)


def test_all_on_device_is_pure_compute():
    placement = Placement.uniform(8, 1e-3, other_compute_s=2e-3)
    forecast = predict_step(placement, PROFILE)
    assert forecast.step_s == pytest.approx(10e-3)
    assert forecast.bottleneck is Bottleneck.COMPUTE
    assert forecast.fill_s == 0.0
    assert min_prefetch_depth(placement, PROFILE) == 0


def test_layer_ahead_hides_transfers_except_the_fill():
    # 10 MB per layer over 25 GB/s = 0.4 ms (+10 us) < 1 ms of compute: only layer 0's copy shows.
    placement = Placement.uniform(16, 1e-3, host_bytes_per_layer=10**7)
    copy = PROFILE.link("host->device").transfer_time(10**7)
    assert predict_step(placement, PROFILE, 0).step_s == pytest.approx(16 * (1e-3 + copy))
    layer_ahead = predict_step(placement, PROFILE, 1)
    assert layer_ahead.step_s == pytest.approx(copy + 16e-3)
    assert layer_ahead.fill_s == pytest.approx(copy)
    assert min_prefetch_depth(placement, PROFILE) == 1


def test_link_bound_step_reports_the_link():
    # 100 MB per layer = 4 ms per copy >> 1 ms compute: the step is the PCIe time plus the last compute.
    placement = Placement.uniform(16, 1e-3, host_bytes_per_layer=10**8)
    forecast = predict_step(placement, PROFILE, 1)
    copy = PROFILE.link("host->device").transfer_time(10**8)
    assert forecast.bottleneck is Bottleneck.HOST_TO_DEVICE
    assert forecast.step_s == pytest.approx(16 * copy + 1e-3)


def test_disk_two_stage_pipeline_needs_depth_two():
    # disk read 0.8 ms then PCIe 0.2 ms: together above 0.9 ms compute, each alone below it.
    disk = Link("disk", 1e9, 0.0)
    pcie = Link("pcie", 4e9, 0.0)
    profile = LinkProfile({"disk->host": disk, "host->device": pcie})
    placement = Placement.uniform(32, 0.9e-3, disk_bytes_per_layer=8 * 10**5)
    assert predict_step(placement, profile, 2).step_s < predict_step(placement, profile, 1).step_s
    assert min_prefetch_depth(placement, profile) == 2
    assert predict_step(placement, profile, 2).bottleneck is Bottleneck.COMPUTE


SECOND = Link("one byte per second", 1.0, 0.0)  # bytes = seconds: hand-checkable timelines


def _cpu_host(copies: float, disk: float = 1.0) -> LinkProfile:
    """A CPU host whose copies (disk reads) and compute slow each other by ``copies`` (``disk``) both ways."""
    links = {key: SECOND for key in ("host->device", "device->device", "disk->host")}
    return LinkProfile(links, serial_mover=True, contention=Contention(copies, copies, disk, disk))


def test_serial_mover_runs_a_layers_gather_copies_and_reads_in_turn():
    """CPU host: one mover thread; device gathers are mover work beside compute, not added to compute."""
    layer = LayerLoad(1.0, device_bytes=1, host_bytes=1, disk_bytes=1)  # job: 1 gather + 1 copy + 1 read + 1 copy
    forecast = predict_step(Placement((layer, layer)), _cpu_host(1.0), 1)
    # job 0: [0, 4]; compute 0: [4, 5]; job 1 (issued at start, after job 0): [4, 8]; compute 1: [8, 9]
    assert forecast.step_s == pytest.approx(9.0)
    assert (forecast.host_to_device_s, forecast.disk_s, forecast.compute_s) == pytest.approx((6.0, 2.0, 2.0))
    assert forecast.lower_bound_s == pytest.approx(8.0)  # the mover's busy time: copies + reads
    assert forecast.bottleneck is Bottleneck.HOST_TO_DEVICE
    streams = predict_step(Placement((layer, layer)), LinkProfile(_cpu_host(1.0).links), 1)
    assert streams.step_s < forecast.step_s  # CUDA: reads and copies pipeline, gathers go with compute


def test_contention_stretches_overlapping_copies_and_compute():
    layer = LayerLoad(2.0, host_bytes=1)  # compute 2 s, copy 1 s
    two = Placement((layer, layer))
    assert predict_step(two, _cpu_host(1.0), 1).step_s == pytest.approx(5.0)  # copy 0 [0, 1], computes back to back
    # contention 1.5: compute 0 overlaps job 1 for 1 s, so both take 0.5 s longer: compute 0 [1, 3.5]
    assert predict_step(two, _cpu_host(1.5), 1).step_s == pytest.approx(5.5)
    # contention 2 (fully shared): the same time as no prefetch at all
    assert predict_step(two, _cpu_host(2.0), 1).step_s == pytest.approx(predict_step(two, _cpu_host(2.0), 0).step_s)
    assert predict_step(two, _cpu_host(2.0), 0).step_s == pytest.approx(6.0)  # depth 0 overlaps nothing


def test_disk_contention_stretches_the_overlapped_share_of_disk_reads():
    layer = LayerLoad(2.0, disk_bytes=1)  # compute 2 s; job: read 1 s, then copy it 1 s
    two = Placement((layer, layer))
    # job 0 [0, 2]; compute 0 [2, 4] overlaps job 1 (2 s, half read, half copy) for 2 s
    assert predict_step(two, _cpu_host(1.0, 1.0), 1).step_s == pytest.approx(6.0)
    # only the read's half of the overlap is stretched: +0.5 s on compute 0 and on job 1
    disk_only = predict_step(two, _cpu_host(1.0, 1.5), 1)
    assert disk_only.step_s == pytest.approx(6.5)
    assert (disk_only.disk_s, disk_only.host_to_device_s) == pytest.approx((2.5, 2.0))
    both = predict_step(two, _cpu_host(1.5, 1.5), 1)  # the whole overlap is stretched
    assert both.step_s == pytest.approx(7.0)
    assert predict_step(two, _cpu_host(1.0, 2.0), 0).step_s == pytest.approx(8.0)  # depth 0 overlaps nothing


def test_disk_read_ahead_runs_the_disk_beside_the_movers_copies():
    """CPU host with read-ahead: every layer's disk read is in flight on the engine's threads from the start,
    so the mover only copies (1 s) and lands each read (0 s here); the disk (2 s per layer) sets the pace."""
    links = {"device->device": SECOND, "disk->host": SECOND, "host->device": Link("instant", 1e18, 0.0)}
    profile = LinkProfile(links, serial_mover=True)
    layer = LayerLoad(1.0, device_bytes=1, disk_bytes=2)  # compute 1 s, gather 1 s, read 2 s
    three = Placement((layer,) * 3)
    # in turn (no read-ahead): job 0 [0, 3], compute [3, 4]; job 1 [3, 6], compute [6, 7]; job 2 [6, 9], [9, 10]
    assert predict_step(three, profile, 1).step_s == pytest.approx(10.0)
    # reads back to back [0, 2], [2, 4], [4, 6]: layer i computes once its read lands: [2, 3], [4, 5], [6, 7]
    ahead = predict_step(three, profile, 1, read_ahead=4)
    assert ahead.step_s == pytest.approx(7.0)
    assert ahead.lower_bound_s == pytest.approx(6.0) and ahead.bottleneck is Bottleneck.DISK


def test_one_sided_contention_slows_only_that_side():
    layer = LayerLoad(1.0, host_bytes=2)  # compute 1 s, copy 2 s: compute 0 overlaps all of job 1's first second
    two = Placement((layer, layer))
    links = _cpu_host(1.0).links
    compute_only = LinkProfile(links, serial_mover=True, contention=Contention(compute_by_copies=2.0))
    # job 0 [0, 2]; compute 0 [2, 4] at half speed beside job 1 [2, 4]; compute 1 [4, 5]
    assert predict_step(two, compute_only, 1).step_s == pytest.approx(5.0)
    assert predict_step(two, compute_only, 1).compute_s == pytest.approx(3.0)
    copies_only = LinkProfile(links, serial_mover=True, contention=Contention(copies_by_compute=1.5))
    # compute 0 [2, 3] at full speed; job 1 does 1/1.5 of a second's work by then, the rest alone: ends at 4 + 1/3
    forecast = predict_step(two, copies_only, 1)
    assert forecast.step_s == pytest.approx(4.0 + 1.0 / 3.0 + 1.0)
    assert forecast.host_to_device_s == pytest.approx(4.0 + 1.0 / 3.0)


def test_layer_overhead_delays_compute_and_a_busy_movers_next_job():
    layer = LayerLoad(1.0, host_bytes=2)  # compute 1 s, job 2 s: the mover is the bottleneck
    three = Placement((layer,) * 3)
    links = _cpu_host(1.0).links
    assert predict_step(three, LinkProfile(links, serial_mover=True), 1).step_s == pytest.approx(7.0)
    # each gather returns 0.5 s after its data is ready, and only then submits the next job:
    # job 0 [0, 2], compute 0 [2.5, 3.5]; job 1 [2.5, 4.5], compute 1 [5, 6]; job 2 [5, 7], compute 2 [7.5, 8.5]
    slow = LinkProfile(links, serial_mover=True, layer_overhead_s=0.5)
    forecast = predict_step(three, slow, 1)
    assert forecast.step_s == pytest.approx(8.5)
    assert forecast.compute_s == pytest.approx(3 * 1.5)  # the overhead runs on the compute thread
    # on CUDA the next job is queued without waiting for this one: only the computes move
    queued = predict_step(three, LinkProfile(links, layer_overhead_s=0.5), 1)
    assert queued.step_s == pytest.approx(7.5)


def test_jitter_slows_a_balanced_pipeline_and_nothing_else():
    balanced = Placement.uniform(16, 1.0, host_bytes_per_layer=1)  # compute 1 s, copy 1 s per layer
    profile = _cpu_host(1.0)
    exact = predict_step(balanced, profile, 1)
    noisy = predict_step(balanced, profile, 1, jitter=0.15)
    assert exact.step_s == pytest.approx(17.0)  # the fill, then 16 computes back to back
    # each layer waits on the slower of two noisy stages: E[max] of two unit means with cv 0.15 is ~1.08
    assert 17.5 < noisy.step_s < 19.5
    assert noisy.compute_s == exact.compute_s and noisy.host_to_device_s == exact.host_to_device_s
    compute_only = Placement.uniform(16, 1.0)  # one stage: its sum's mean is the sum of the means
    assert predict_step(compute_only, profile, 1, jitter=0.3).step_s == pytest.approx(16.0)
    assert predict_step(balanced, profile, 1, jitter=0.15).step_s == noisy.step_s  # seeded: deterministic
    with pytest.raises(InvalidConfigError, match="jitter=-0.1 must be a coefficient of variation"):
        predict_step(balanced, profile, 1, jitter=-0.1)


def test_prefetch_depth_is_validated():
    with pytest.raises(InvalidConfigError, match="prefetch_depth"):
        predict_step(Placement.uniform(2, 1e-3), PROFILE, -1)
    with pytest.raises(InvalidConfigError):
        LayerLoad(1e-3, host_bytes=-1)
    with pytest.raises(InvalidConfigError):
        Placement(())


def _loads(max_size: int, **fields: st.SearchStrategy) -> st.SearchStrategy:
    """Lists of up to ``max_size`` random layer loads (``fields``: more of LayerLoad's fields drawn)."""
    return st.lists(st.builds(LayerLoad, compute_s=st.floats(0, 5e-3), device_bytes=st.integers(0, 10**8),
                              host_bytes=st.integers(0, 10**8), disk_bytes=st.integers(0, 10**8), **fields),
                    min_size=1, max_size=max_size)


layers = _loads(24, host_transfers=st.integers(1, 8), disk_transfers=st.integers(1, 8))


@settings(max_examples=200, deadline=None)
@given(layers=layers, other=st.floats(0, 5e-3), depth=st.integers(0, 6))
def test_step_time_is_bounded_by_max_and_sum_of_resources(layers, other, depth):
    forecast = predict_step(Placement(tuple(layers), other), PROFILE, depth)
    busy = (forecast.compute_s, forecast.host_to_device_s, forecast.disk_s)
    slack = 1e-12 * max(1.0, sum(busy))
    assert forecast.step_s >= max(busy) - slack
    assert forecast.step_s >= forecast.fill_s + forecast.compute_s - slack
    assert forecast.step_s <= sum(busy) + slack
    assert 0 < forecast.overlap_efficiency <= 1 + 1e-9 or forecast.step_s == 0


@settings(max_examples=100, deadline=None)
@given(layers=layers, depth=st.integers(0, 6))
def test_deeper_prefetch_never_slows_the_step(layers, depth):
    placement = Placement(tuple(layers))
    shallow = predict_step(placement, PROFILE, depth).step_s
    assert predict_step(placement, PROFILE, depth + 1).step_s <= shallow * (1 + 1e-12)
    chosen = min_prefetch_depth(placement, PROFILE)
    best = predict_step(placement, PROFILE, len(layers)).step_s
    assert predict_step(placement, PROFILE, chosen).step_s <= best * 1.01 + 1e-15
    if chosen > 0:
        assert predict_step(placement, PROFILE, chosen - 1).step_s > best * 1.01


@settings(max_examples=200, deadline=None)
@given(layers=layers, other=st.floats(0, 5e-3), depth=st.integers(0, 6),
       slowdowns=st.tuples(*[st.floats(1.0, MAX_SLOWDOWN)] * 4), jitter=st.sampled_from([0.0, 0.2]))
def test_serial_mover_step_is_bounded_by_its_busy_times(layers, other, depth, slowdowns, jitter):
    profile = LinkProfile(PROFILE.links, serial_mover=True, contention=Contention(*slowdowns))
    forecast = predict_step(Placement(tuple(layers), other), profile, depth, jitter=jitter)
    busy = forecast.compute_s + forecast.host_to_device_s + forecast.disk_s
    slack = 1e-12 * max(1.0, busy)
    assert forecast.step_s >= forecast.lower_bound_s - slack
    assert forecast.step_s >= forecast.fill_s + forecast.compute_s - slack
    assert forecast.step_s <= busy + slack


# ------------------------------------------------------------------------------------------- split executor
SPLIT_LINKS = LinkProfile.from_presets("pcie5", "nvme-gen4")


def test_split_step_is_the_slower_side_of_each_layer_plus_the_merge():
    """Two layers, device compute 1 ms beside 2 GB of host KV at 100 GB/s (20 ms): the CPUs bound each layer; each
    layer adds the query's copy down (10 us + 8 KB / 50 GB/s) and its (out, lse) share's copy up (10 us + 16 KB)."""
    placement = Placement((LayerLoad(1e-3, device_bytes=5 * 10**9, host_bytes=2 * 10**9),) * 2, other_compute_s=2e-3)
    fc = predict_split_step(placement, SPLIT_LINKS, 100e9, query_bytes=8192, partial_bytes=16512)
    merge = (10e-6 + 8192 / 50e9) + (10e-6 + 16512 / 50e9)
    assert fc.step_s == pytest.approx(2 * (0.02 + merge) + 2e-3, rel=1e-12)
    assert fc.host_attention_s == pytest.approx(0.04) and fc.compute_s == pytest.approx(4e-3)
    assert fc.host_to_device_s == pytest.approx(2 * merge) and fc.disk_s == 0
    assert fc.bottleneck is Bottleneck.HOST_ATTENTION and fc.prefetch_depth == 0 and fc.fill_s == 0
    assert fc.lower_bound_s == pytest.approx(0.04)
    device_bound = predict_split_step(Placement((LayerLoad(0.05, host_bytes=2 * 10**9),) * 2), SPLIT_LINKS, 100e9)
    assert device_bound.step_s == pytest.approx(0.1) and device_bound.bottleneck is Bottleneck.COMPUTE


def test_split_disk_share_is_read_ahead_then_attended_on_the_cpus():
    """7 GB per layer from a Gen4 NVMe (1 s + 80 us each, queued from step start: read-ahead 4), then attended at
    100 GB/s (70 ms) once landed: the second layer waits for its own read, which followed the first."""
    read = 80e-6 + 1.0
    placement = Placement((LayerLoad(1e-3, disk_bytes=7 * 10**9),) * 2)
    fc = predict_split_step(placement, SPLIT_LINKS, 100e9)
    assert fc.step_s == pytest.approx(2 * read + 0.07, rel=1e-12)
    assert fc.disk_s == pytest.approx(2 * read) and fc.bottleneck is Bottleneck.DISK
    no_ahead = predict_split_step(placement, SPLIT_LINKS, 100e9, read_ahead=0)
    assert no_ahead.step_s == pytest.approx(2 * (read + 0.07), rel=1e-12)  # layer 1's read waits for layer 1


def test_split_on_a_cpu_host_attends_every_share_on_the_compute_thread():
    """No link to cross: one thread computes the layer (5 ms), then attends its device and host blocks (2 GB at
    10 GB/s) in turn."""
    placement = Placement((LayerLoad(5e-3, device_bytes=10**9, host_bytes=10**9),) * 3)
    fc = predict_split_step(placement, SPLIT_LINKS, 10e9, query_bytes=8192, partial_bytes=16512,
                            on_compute_thread=True)
    assert fc.step_s == pytest.approx(3 * 0.205, rel=1e-12) and fc.host_to_device_s == 0
    assert fc.attention_on_compute and fc.lower_bound_s == pytest.approx(fc.step_s)
    assert fc.bottleneck is Bottleneck.HOST_ATTENTION  # attention (0.6 s) outweighs the layers' compute (15 ms)


@pytest.mark.parametrize("rate", [0.0, -1.0, math.inf, math.nan])
def test_split_step_needs_a_positive_attention_rate(rate):
    with pytest.raises(InvalidConfigError, match="host_attention_bytes_per_s"):
        predict_split_step(Placement((LayerLoad(1e-3),)), SPLIT_LINKS, rate)


@settings(max_examples=50, deadline=None)
@given(layers=st.lists(st.tuples(st.floats(0, 0.01), st.integers(0, 10**9), st.integers(0, 10**9),
                                 st.integers(0, 10**9)), min_size=1, max_size=8),
       cpu_host=st.booleans(), ahead=st.integers(0, 4))
def test_split_step_is_bounded_by_its_busy_times(layers, cpu_host, ahead):
    loads = tuple(LayerLoad(c, device_bytes=d, host_bytes=h, disk_bytes=k) for c, d, h, k in layers)
    fc = predict_split_step(Placement(loads), SPLIT_LINKS, 50e9, query_bytes=4096, partial_bytes=8192,
                            read_ahead=ahead, on_compute_thread=cpu_host)
    total = fc.compute_s + fc.host_attention_s + fc.host_to_device_s + fc.disk_s
    assert fc.lower_bound_s * (1 - 1e-9) <= fc.step_s <= total * (1 + 1e-9) + 1e-12


def test_host_attention_round_trips_and_older_profiles_still_load(tmp_path):
    measured = LinkProfile.from_presets().replace()
    measured.host_attention = HostAttention(30e9, 9e9, 16, "native")
    path = tmp_path / "profile.json"
    measured.save(path)
    assert LinkProfile.load(path).host_attention == HostAttention(30e9, 9e9, 16, "native")
    data = json.loads(path.read_text())
    del data["host_attention"]  # a profile written before the kernel was measured
    path.write_text(json.dumps(data))
    assert LinkProfile.load(path).host_attention is None
    data["host_attention"] = {"bandwidth_bytes_per_s": -1, "single_thread_bytes_per_s": 1e9, "threads": 2}
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidConfigError, match="bandwidth_bytes_per_s"):
        LinkProfile.load(path)
    with pytest.raises(InvalidConfigError, match="threads"):
        HostAttention(1e9, 1e9, 0)


# ------------------------------------------------------------------------------------------- runs of equal stages
runs = _loads(4, repeat=st.integers(1, 2 * DIRECT_STAGES + 50))  # past DIRECT_STAGES: the rest is jumped over


@settings(max_examples=60, deadline=None)
@given(loads=runs, other=st.floats(0, 5e-3), depth=st.integers(0, 3), serial=st.booleans(),
       read_ahead=st.sampled_from([0, DISK_READ_AHEAD]), slowdowns=st.tuples(*[st.floats(1.0, MAX_SLOWDOWN)] * 4),
       overhead=st.sampled_from([0.0, 3e-5]))
def test_a_run_of_equal_stages_forecasts_as_the_stages_spelled_out(loads, other, depth, serial, read_ahead,
                                                                   slowdowns, overhead):
    profile = LinkProfile(PROFILE.links, serial_mover=serial, contention=Contention(*slowdowns),
                          layer_overhead_s=overhead)
    placement = Placement(tuple(loads), other)
    spelled = Placement(placement.spelled_out(), other)
    assert spelled.stages == placement.stages == sum(load.repeat for load in loads)
    fast = predict_step(placement, profile, depth, read_ahead=read_ahead)
    slow = predict_step(spelled, profile, depth, read_ahead=read_ahead)
    for name in ("step_s", "compute_s", "host_to_device_s", "disk_s", "fill_s"):
        assert getattr(fast, name) == pytest.approx(getattr(slow, name), rel=1e-9, abs=1e-15), name


def test_a_long_run_costs_logarithmic_work(monkeypatch):
    """2**40 equal stages: the pipeline steps through DIRECT_STAGES of them and jumps the rest."""
    steps = []
    advance = bandwidth._advance

    def counted(*args: object) -> None:
        steps.append(args)
        assert len(steps) <= 2 * DIRECT_STAGES, "the pipeline steps through every stage of a run"
        advance(*args)

    monkeypatch.setattr(bandwidth, "_advance", counted)
    load = LayerLoad(1e-3, host_bytes=10**6, disk_bytes=10**5, repeat=2**40)
    forecast = predict_step(Placement((load,)), PROFILE, 1, read_ahead=DISK_READ_AHEAD)
    assert forecast.step_s == pytest.approx(forecast.lower_bound_s, rel=1e-9)  # the fill is nothing beside 2**40


def test_repeat_must_be_a_positive_int():
    with pytest.raises(InvalidConfigError, match="repeat=0 must be an int >= 1"):
        LayerLoad(1e-3, repeat=0)
