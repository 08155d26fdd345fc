"""Calibration: microbenchmarks of every link the KV cache moves over, and their fit into a LinkProfile.

What ``tierkv bench`` measures and fits; not on the decode path (``import tierkv`` does not import it). What
is measured (each at transfer sizes from ``min_size`` to ``max_size``, every 4x), module by module:

========================  =============  ===================================================================
host->host   memcpy       links          ``dst.copy_(src)`` between two CPU tensors (torch uses every core)
device->device gather     links          blocks from random slots of a pool into one staging tensor:
                                         ``index_select(out=)`` and one ``copy_`` per block, each beside a
                                         plain copy of the same bytes (the ratio is the price of gathering)
store gather              links          ``KVStore.read_into`` from device-tier and host-tier blocks into
                                         executor staging, over a layer larger than the CPU's last-level cache
host<->device (CUDA)      links          pinned and pageable copies each way, and both ways at once
disk->host / host->disk   disk           each disk engine beside a *raw* O_DIRECT baseline of the same request
                                         size; and batches of 1-64 scattered blocks (a layer's disk blocks)
contention (CPU only)     contention     the store's gather, and disk reads, on a second thread beside a
                                         compute: each side's slowdown while the other runs throughout
layer overhead (CPU only) overhead       the exact-gather executor's own work per layer (its telemetry)
========================  =============  ===================================================================

:func:`run_bench` runs them all (``run``); :func:`build_profile` (``fit``) turns the series into a
:class:`~tierkv.bandwidth.LinkProfile`; :func:`plot` draws them. The KV layout and the store the store-level
series run on are in ``kv``, the timing rules (warm up, median of ``repeats``, CUDA events after a sync) in
``timing``, the machine description in ``machine``; each phase and point measured is reported to a
:class:`~tierkv.calibrate.report.Progress` (``report``), which ``tierkv bench`` prints.

Honesty rules: warm up before timing; report the median of ``repeats``; on CUDA, time with events and
synchronize first; read disk data that was really written (a sparse or fallocated file reads as zeros
without touching the disk) through O_DIRECT, or drop the file's page cache before each read when an engine
had to fall back to buffered I/O. On a CPU-only host there is no PCIe: the "host->device" link of the
profile is the store's copy of host-tier blocks into staging in CPU memory, and ``machine`` says so.
"""

from tierkv.calibrate.config import BenchConfig, GiB, KiB, MiB, transfer_sizes
from tierkv.calibrate.contention import measure_contention
from tierkv.calibrate.disk import RawDirect, measure_disk
from tierkv.calibrate.fit import build_profile
from tierkv.calibrate.links import measure_cuda_links, measure_gather, measure_memcpy, measure_store_gather
from tierkv.calibrate.machine import filesystem_of, machine_description
from tierkv.calibrate.overhead import measure_layer_overhead
from tierkv.calibrate.plot import plot
from tierkv.calibrate.results import BenchResult, Measurement
from tierkv.calibrate.run import run_bench
from tierkv.calibrate.timing import median_cuda_seconds, median_seconds

__all__ = [
    "BenchConfig",
    "BenchResult",
    "GiB",
    "KiB",
    "Measurement",
    "MiB",
    "RawDirect",
    "build_profile",
    "filesystem_of",
    "machine_description",
    "measure_contention",
    "measure_cuda_links",
    "measure_disk",
    "measure_gather",
    "measure_layer_overhead",
    "measure_memcpy",
    "measure_store_gather",
    "median_cuda_seconds",
    "median_seconds",
    "plot",
    "run_bench",
    "transfer_sizes",
]
