"""One calibration run: every series in order, then the fit (what ``tierkv bench`` calls)."""

from __future__ import annotations

from collections.abc import Callable

from tierkv.bandwidth import HostAttention
from tierkv.calibrate.attention import measure_host_attention
from tierkv.calibrate.config import BenchConfig, transfer_sizes
from tierkv.calibrate.contention import measure_contention
from tierkv.calibrate.disk import measure_disk
from tierkv.calibrate.fit import build_profile
from tierkv.calibrate.kv import compute_device
from tierkv.calibrate.links import measure_cuda_links, measure_gather, measure_memcpy, measure_store_gather
from tierkv.calibrate.machine import machine_description
from tierkv.calibrate.overhead import measure_layer_overhead
from tierkv.calibrate.report import SILENT, Progress
from tierkv.calibrate.results import BenchResult, Measurement
from tierkv.io import available_engines


def run_bench(cfg: BenchConfig, *, progress: Progress = SILENT,
              compute: Callable[[], object] | None = None) -> BenchResult:
    """Measure every link of this host and fit the profile; ``compute``: one unit of the work to measure
    contention against (:func:`~tierkv.calibrate.contention.measure_contention`), e.g. a model's decode step;
    ``progress`` hears of each phase and each point measured."""
    sizes = transfer_sizes(cfg.min_size, cfg.max_size)
    machine = machine_description(cfg.directory)
    measurements: list[Measurement] = []
    measurements += measure_memcpy(sizes, cfg, progress)
    attention_rows, attention = measure_host_attention(cfg, progress)
    measurements += attention_rows
    device = compute_device()
    measurements += measure_gather(sizes, cfg, device, progress)
    measurements += measure_store_gather(sizes, cfg, device, progress)
    if device.type == "cuda":
        measurements += measure_cuda_links(sizes, cfg, device, progress)
    disk_rows, notes = measure_disk(sizes, cfg, progress)
    measurements += disk_rows
    engines = list(cfg.engines) if cfg.engines is not None else available_engines()
    disk_engine = next((e for e in available_engines() if e in engines), None)
    contention, overhead = None, 0.0
    if device.type == "cpu":
        contention = measure_contention(cfg, disk_engine, compute, progress)
        overhead = measure_layer_overhead(cfg, progress)
    profile, fit_notes = build_profile(measurements, machine, disk_engine, contention, overhead)
    if isinstance(attention, HostAttention):
        profile.host_attention = attention
    else:
        fit_notes.append(attention)
    return BenchResult(measurements, profile, machine, notes + fit_notes)
