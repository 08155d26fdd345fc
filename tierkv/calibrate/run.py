"""One calibration run: every series in order, then the fit (what ``tierkv bench`` calls)."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.bandwidth import HostAttention
from tierkv.calibrate.attention import measure_host_attention
from tierkv.calibrate.config import BenchConfig, MiB, transfer_sizes
from tierkv.calibrate.contention import measure_contention
from tierkv.calibrate.disk import measure_disk
from tierkv.calibrate.fit import build_profile
from tierkv.calibrate.kv import compute_device
from tierkv.calibrate.links import measure_cuda_links, measure_gather, measure_memcpy, measure_store_gather
from tierkv.calibrate.machine import machine_description
from tierkv.calibrate.overhead import measure_layer_overhead
from tierkv.calibrate.results import BenchResult, Measurement
from tierkv.io import available_engines


def run_bench(cfg: BenchConfig, *, progress: Callable[[str], None] = lambda _: None,
              compute: Callable[[], object] | None = None) -> BenchResult:
    """Measure every link of this host and fit the profile; ``compute``: one unit of the work to measure
    contention against (:func:`~tierkv.calibrate.contention.measure_contention`), e.g. a model's decode step."""
    sizes = transfer_sizes(cfg.min_size, cfg.max_size)
    machine = machine_description(cfg.directory)
    measurements: list[Measurement] = []
    progress("host memcpy")
    measurements += measure_memcpy(sizes, cfg)
    progress("host attention kernel (K/V attended in place)")
    attention_rows, attention = measure_host_attention(cfg)
    measurements += attention_rows
    device = compute_device()
    progress(f"block gather ({device}): a plain copy, index_select and a copy per block")
    measurements += measure_gather(sizes, cfg, device)
    progress(f"the store's own gather (KVStore.read_into) from {device} and host blocks")
    measurements += measure_store_gather(sizes, cfg, device)
    if device.type == "cuda":
        progress("host<->device copies")
        measurements += measure_cuda_links(sizes, cfg, device)
    disk = f"disk ({cfg.disk_bytes // MiB} MiB file in {cfg.directory})"
    disk_rows, notes = measure_disk(sizes, cfg, lambda what: progress(f"{disk}: {what}"))
    measurements += disk_rows
    engines = list(cfg.engines) if cfg.engines is not None else available_engines()
    disk_engine = next((e for e in available_engines() if e in engines), None)
    contention, overhead = None, 0.0
    if device.type == "cpu":
        progress("copies and disk reads beside compute (contention), the cache's own work per layer")
        contention = measure_contention(cfg, disk_engine, compute)
        overhead = measure_layer_overhead(cfg)
    profile, fit_notes = build_profile(measurements, machine, disk_engine, contention, overhead)
    if isinstance(attention, HostAttention):
        profile.host_attention = attention
    else:
        fit_notes.append(attention)
    return BenchResult(measurements, profile, machine, notes + fit_notes)
