"""Microbenchmarks of every link the KV cache moves over, and their fit into a :class:`LinkProfile`.

What is measured (each at transfer sizes from ``min_size`` to ``max_size``, every 4x):

========================  ==========================================================================
host->host   memcpy       ``dst.copy_(src)`` between two CPU tensors (torch uses every core)
device->device gather     blocks from random slots of a pool into one staging tensor: ``index_select(out=)``
                          and one ``copy_`` per block, each beside a plain copy of the same bytes (the
                          ratio is the price of gathering)
store gather              ``KVStore.read_into`` from device-tier and host-tier blocks into executor staging,
                          over a layer larger than the CPU's last-level cache (what a decode step does)
disk->host / host->disk   each disk engine, one batch of ``size``-byte requests over a file of
                          ``disk_bytes``, beside a *raw* baseline: 16 threads issuing bare O_DIRECT
                          ``preadv``/``pwritev`` of the same request size (no engine, no checks); and
                          reads of one layer's blocks: batches of 1-64 scattered ``block_bytes`` requests
layer overhead (CPU only) the exact-gather executor's own work per layer on the compute thread (telemetry)
contention (CPU only)     the store's gather, and disk reads of a layer's blocks, on a second thread beside
                          a matrix-vector product (or a given compute, e.g. a model's decode step): each
                          side's slowdown while the other runs throughout
host<->device (CUDA)      pinned and pageable copies each way, and both ways at once on two streams
========================  ==========================================================================

Honesty rules: warm up before timing; report the median of ``repeats``; on CUDA, time with events and
synchronize first; read disk data that was really written (a sparse or fallocated file reads as zeros
without touching the disk) through O_DIRECT, or drop the file's page cache before each read when an
engine had to fall back to buffered I/O. On a CPU-only host there is no PCIe: the "host->device" link of
the profile is the store's copy of host-tier blocks into staging in CPU memory, and ``machine`` says so.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import datetime
import itertools
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from tierkv.bandwidth import MAX_SLOWDOWN, Contention, Link, LinkProfile, fit_link
from tierkv.io import ALIGN, aligned_empty, available_engines, open_disk_file
from tierkv.io.base import DiskFile, chunk_bytes, queue_depth

if TYPE_CHECKING:
    from tierkv.store import KVStore

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CONTENTION_SAMPLES = 9


@dataclass(frozen=True, slots=True)
class Measurement:
    """The median time of one operation moving ``nbytes`` in ``transfers`` requests/copies over ``link``."""

    link: str  # "host->host", "device->device", "disk->host", "host->disk", "host->device", ...
    method: str  # "memcpy", "gather index_select", "native", "raw O_DIRECT", "pinned", ...
    size: int  # transfer size the row is plotted at: bytes per request (disk) or per copy (memory)
    nbytes: int  # bytes moved by one timed operation
    transfers: int  # requests or copies in one timed operation
    seconds: float  # median over the repeats

    @property
    def gbps(self) -> float:
        """Achieved bandwidth in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure. :meth:`quick` is the ~10 s variant the tests run."""

    directory: Path
    min_size: int = 4 * KiB
    max_size: int = 1 * GiB
    disk_bytes: int = 1 * GiB
    block_bytes: int = 256 * KiB  # gather unit: one block of one layer
    engines: tuple[str, ...] | None = None  # None: every engine that loads here
    warmup: int = 1
    repeats: int = 5
    disk_point_bytes: int = 256 * MiB  # most bytes one disk point moves (small requests move less)
    contention_bytes: int = 64 * MiB  # bytes copied (and read by the compute) per contention sample
    gather_pool_bytes: int = 1 * GiB  # one layer's KV for the store gather: larger than a last-level cache

    def __post_init__(self) -> None:
        if not (ALIGN <= self.min_size <= self.max_size):
            raise ValueError(f"need {ALIGN} <= min_size <= max_size, got {self.min_size}, {self.max_size}.")
        if self.disk_bytes < self.min_size or self.disk_bytes % ALIGN:
            raise ValueError(f"disk size {self.disk_bytes} must be a multiple of {ALIGN} and >= min_size.")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0.")

    @classmethod
    def quick(cls, directory: Path, **overrides: object) -> BenchConfig:
        """Small sizes and few repeats: checks the whole pipeline in seconds; numbers are indicative."""
        small = cls(directory, max_size=4 * MiB, disk_bytes=32 * MiB, block_bytes=64 * KiB, repeats=3,
                    disk_point_bytes=8 * MiB, contention_bytes=8 * MiB, gather_pool_bytes=32 * MiB)  # fmt: skip
        return dataclasses.replace(small, **overrides)


@dataclass
class BenchResult:
    """Everything one run measured, the profile fitted from it and the machine it ran on."""

    measurements: list[Measurement]
    profile: LinkProfile
    machine: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def series(self, link: str, method: str) -> list[Measurement]:
        return [m for m in self.measurements if m.link == link and m.method == method]


def transfer_sizes(min_size: int, max_size: int) -> list[int]:
    """Sizes from ``min_size`` to ``max_size`` in steps of 4x (4 KiB, 16 KiB ... 1 GiB)."""
    sizes, size = [], min_size
    while size <= max_size:
        sizes.append(size)
        size *= 4
    return sizes


# --------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def filesystem_of(directory: Path) -> str:
    """``"ext4 on /dev/vda (/)"``: the mount that holds ``directory`` (longest mount-point prefix)."""
    target = os.path.realpath(directory)
    best = None
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and (
            best is None or len(mount) > len(best.mountpoint)
        ):
            best = part
    return "unknown" if best is None else f"{best.fstype} on {best.device} ({best.mountpoint})"


def machine_description(directory: Path) -> dict[str, str]:
    """What a reader needs to judge the numbers: CPU, cores, RAM, GPU, the disk's filesystem, the date."""
    cuda = torch.cuda.is_available()
    machine = {
        "cpu": _cpu_model(),
        "cores": f"{os.cpu_count()} logical ({torch.get_num_threads()} torch threads)",
        "ram": f"{psutil.virtual_memory().total / GiB:.1f} GiB",
        "gpu": torch.cuda.get_device_name(0) if cuda else "none",
        "disk_dir": str(directory),
        "filesystem": filesystem_of(directory),
        "kernel": platform.release(),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),  # other work skews a 2-core box
        "torch": torch.__version__,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    if not cuda:
        machine["host->device"] = (
            "CPU-only host: the store's copy from the host tier into staging in CPU memory; no PCIe"
        )
        machine["device->host"] = "CPU-only host: memcpy from the device tier into the host tier; no PCIe"
        machine["device->device"] = "the store's block gather within CPU memory (read_into the staging tensor)"
    return machine


# --------------------------------------------------------------------------- timing


def _seconds(op: Callable[[], object]) -> float:
    """Wall time of one call of ``op``."""
    start = time.perf_counter()
    op()
    return time.perf_counter() - start


def _median_seconds(op: Callable[[], object], *, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median wall time of ``op``; ``inner`` calls per sample so a sample is not all clock noise."""
    for _ in range(warmup):
        op()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            op()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def _median_cuda_seconds(op: Callable[[], object], *, warmup: int, repeats: int, inner: int = 1) -> float:
    """Median time of ``op`` between CUDA events on the current stream, synchronized before and after."""
    for _ in range(warmup):
        op()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            op()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / inner)
    torch.cuda.synchronize()
    return statistics.median(samples)


def _inner(size: int) -> int:
    """Repetitions per sample: ~16 MiB per sample, so 4 KiB copies are timed over ~4000 calls."""
    return max(1, min(4096, (16 * MiB) // size))


# --------------------------------------------------------------------------- memory links


def measure_memcpy(sizes: Sequence[int], cfg: BenchConfig) -> list[Measurement]:
    """host->host: one ``copy_`` of ``size`` bytes between CPU tensors."""
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    out = []
    for size in sizes:
        s, d = src[:size], dst[:size]
        t = _median_seconds(
            lambda s=s, d=d: d.copy_(s), warmup=cfg.warmup, repeats=cfg.repeats, inner=_inner(size)
        )
        out.append(Measurement("host->host", "memcpy", size, size, 1, t))
    return out


def measure_gather(sizes: Sequence[int], cfg: BenchConfig, device: str = "cpu") -> list[Measurement]:
    """device->device: gather ``size // block`` blocks from random slots of a 2x larger pool.

    Three ways of moving the same bytes into the staging tensor: one plain contiguous copy (the ceiling),
    ``index_select(out=)`` (one call) and a ``copy_`` per block (what a naive gather does).
    """
    block = cfg.block_bytes
    sizes = [s for s in sizes if s >= block]
    if not sizes:
        return []
    n_pool = 2 * max(sizes) // block
    pool = torch.ones(n_pool, block, dtype=torch.uint8, device=device)  # [slots, block bytes]
    staging = torch.empty(max(sizes) // block, block, dtype=torch.uint8, device=device)
    timer = _median_cuda_seconds if device == "cuda" else _median_seconds
    rng = np.random.default_rng(0)
    out = []
    for size in sizes:
        k = size // block
        slots = torch.from_numpy(rng.permutation(n_pool)[:k]).to(device)  # scattered, like a real table
        slot_list = slots.tolist()
        dst = staging[:k]
        plain_src = pool[:k]

        def per_block(dst: torch.Tensor = dst, slot_list: list[int] = slot_list) -> None:
            for i, slot in enumerate(slot_list):
                dst[i].copy_(pool[slot])

        ops = {
            "plain copy": lambda dst=dst, src=plain_src: dst.copy_(src),
            "gather index_select": lambda dst=dst, slots=slots: torch.index_select(pool, 0, slots, out=dst),
            "gather per-block copy_": per_block,
        }
        for method, op in ops.items():
            inner = _inner(size) if method != "gather per-block copy_" else max(1, _inner(size) // k)
            t = timer(op, warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)
            out.append(
                Measurement(
                    "device->device", method, size, size, 1 if method != "gather per-block copy_" else k, t
                )
            )
    return out


KV_HEADS, HEAD_DIM, KV_DTYPE = 8, 128, torch.float16  # the store benchmarks' KV layout (Llama-3-8B's)
KV_TOKEN_BYTES = 2 * KV_HEADS * HEAD_DIM * KV_DTYPE.itemsize


def _bench_store(cfg: BenchConfig, device_bytes: int, host_bytes: int, device: str = "cpu") -> KVStore:
    """A ``KVStore`` of the benchmarks' KV layout in ``block_bytes`` blocks (LRU, no disk tier) with these tier
    budgets; the host tier is pinned on CUDA, as the runtime's is."""
    from tierkv.blocks import Tier
    from tierkv.policy import make_policy
    from tierkv.store import KVStore
    from tierkv.tiers.memory import MemoryTier

    return KVStore(MemoryTier(Tier.DEVICE, device_bytes, torch.device(device)),
                   MemoryTier(Tier.HOST, host_bytes, torch.device("cpu"), pin=device == "cuda"),
                   None, make_policy("lru"), _block_tokens(cfg))


def _block_tokens(cfg: BenchConfig) -> int:
    return max(1, cfg.block_bytes // KV_TOKEN_BYTES)


def _kv(tokens: int, device: str = "cpu") -> torch.Tensor:
    """K (or V) of ``tokens`` tokens for one layer, ``[1, H_kv, T, D]``."""
    return torch.ones(1, KV_HEADS, tokens, HEAD_DIM, dtype=KV_DTYPE, device=device)


def measure_store_gather(sizes: Sequence[int], cfg: BenchConfig, device: str = "cpu") -> list[Measurement]:
    """The exact executors' gather as the runtime runs it: ``KVStore.read_into`` of ``size`` bytes of one
    layer into a staging tensor ``[2, 1, H_kv, T, D]``, from blocks on the device tier (``device->device``)
    and on the host tier (``host->device``).

    Each block ``[2, H_kv, block_tokens, D]`` (fp16, 8 KV heads x 128, ``block_bytes``) lands as strided
    per-head slices, with the store's per-segment bookkeeping. Consecutive reads walk through a
    ``gather_pool_bytes`` layer, so they read memory that is not in the CPU's last-level cache, as a decode
    step over a long context does (the plain gather series above reuse one pool and can stay cache-resident).
    """
    from tierkv.blocks import Tier

    token_bytes, block_tokens = KV_TOKEN_BYTES, _block_tokens(cfg)
    block = block_tokens * token_bytes
    sizes = [s - s % block for s in sizes if block <= s <= cfg.gather_pool_bytes // 4]
    if not sizes:
        return []
    tokens = cfg.gather_pool_bytes // block * block_tokens
    timer = _median_cuda_seconds if device == "cuda" else _median_seconds
    staging = torch.empty(2, 1, KV_HEADS, max(sizes) // token_bytes, HEAD_DIM, dtype=KV_DTYPE, device=device)
    out = []
    for source, link in ((Tier.DEVICE, "device->device"), (Tier.HOST, "host->device")):
        slack = 4 * block  # the open tail block (kept on the device) and slab rounding
        pool = tokens * token_bytes
        store = _bench_store(cfg, pool + slack if source == Tier.DEVICE else slack, pool + slack, device)
        kv = _kv(tokens, device)
        store.append(0, kv, kv)
        del kv
        on_source = [seg for seg in store.plan_read(0, 0, tokens) if seg.tier == source]
        first, last = on_source[0].dst, on_source[-1].dst + on_source[-1].length
        for size in sizes:
            n = size // token_bytes
            plans = itertools.cycle([store.plan_read(0, start, start + n) for start in range(first, last - n + 1, n)])
            t = timer(lambda store=store, plans=plans: store.read_into(0, next(plans), staging),
                      warmup=cfg.warmup, repeats=cfg.repeats, inner=_inner(size))
            out.append(Measurement(link, "store read_into", size, size, 1, t))
    return out


def measure_cuda_links(sizes: Sequence[int], cfg: BenchConfig) -> list[Measurement]:
    """host->device and device->host, pinned and pageable, and both directions at once (pinned)."""
    n = max(sizes)
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = {
        "pinned": (
            torch.ones(n, dtype=torch.uint8).pin_memory(),
            torch.empty(n, dtype=torch.uint8).pin_memory(),
        ),
        "pageable": (torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)),
    }
    h2d_stream, d2h_stream = torch.cuda.Stream(), torch.cuda.Stream()
    out = []
    for size in sizes:
        inner = _inner(size)
        for kind, (h_src, h_dst) in host.items():
            src, dst, d = h_src[:size], h_dst[:size], dev_a[:size]
            t = _median_cuda_seconds(lambda d=d, src=src: d.copy_(src, non_blocking=True),
                                     warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)  # fmt: skip
            out.append(Measurement("host->device", kind, size, size, 1, t))
            t = _median_cuda_seconds(lambda d=d, dst=dst: dst.copy_(d, non_blocking=True),
                                     warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)  # fmt: skip
            out.append(Measurement("device->host", kind, size, size, 1, t))
        src, dst = host["pinned"][0][:size], host["pinned"][1][:size]
        up, down = dev_a[:size], dev_b[:size]

        def both_ways(src: torch.Tensor = src, dst: torch.Tensor = dst, up: torch.Tensor = up,
                      down: torch.Tensor = down) -> None:  # fmt: skip
            main = torch.cuda.current_stream()
            h2d_stream.wait_stream(main)
            d2h_stream.wait_stream(main)
            with torch.cuda.stream(h2d_stream):
                up.copy_(src, non_blocking=True)
            with torch.cuda.stream(d2h_stream):
                dst.copy_(down, non_blocking=True)
            main.wait_stream(h2d_stream)
            main.wait_stream(d2h_stream)

        t = _median_cuda_seconds(both_ways, warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)
        out.append(Measurement("host<->device", "pinned both ways", size, 2 * size, 2, t))
    return out


# --------------------------------------------------------------------------- disk


class RawDirect:
    """The baseline: ``depth`` threads issuing bare O_DIRECT preadv/pwritev, pulling from one counter.

    No request checks, no splitting, no handles: what the filesystem gives a minimal program at this queue
    depth and request size. The threads persist across calls, as an engine's do, so neither side pays
    thread start-up inside the timing.
    """

    def __init__(self, path: Path, depth: int) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_DIRECT)
        self._depth = depth
        self._pool = cf.ThreadPoolExecutor(depth, thread_name_prefix="tierkv-raw-io")

    def run(self, requests: list[tuple[int, np.ndarray]], write: bool) -> None:
        call = os.pwritev if write else os.preadv
        counter = itertools.count()

        def worker() -> None:
            while (i := next(counter)) < len(requests):
                offset, view = requests[i]
                done = 0
                while done < view.nbytes:
                    moved = call(self._fd, [view[done:]], offset + done)
                    if moved <= 0:
                        raise OSError(
                            f"raw O_DIRECT {'write' if write else 'read'} stalled at {offset + done}"
                        )
                    done += moved

        for future in [self._pool.submit(worker) for _ in range(min(self._depth, len(requests)))]:
            future.result()

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self._fd)


def _drop_page_cache(path: Path) -> None:
    """Evict the file's clean pages so a buffered read comes from the disk, not from RAM."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_disk(sizes: Sequence[int], cfg: BenchConfig) -> tuple[list[Measurement], list[str]]:
    """disk->host and host->disk through each engine and the raw baseline; returns (rows, notes)."""
    cfg.directory.mkdir(parents=True, exist_ok=True)
    path = cfg.directory / f"tierkv-bench-{os.getpid()}.bin"
    engines = list(cfg.engines) if cfg.engines is not None else available_engines()
    if not engines:
        raise ValueError("no disk engine to measure; give at least one of the available engines.")
    notes: list[str] = []
    depth = queue_depth()
    sizes = [s for s in sizes if s <= cfg.disk_bytes]
    buffer = aligned_empty(min(cfg.disk_bytes, max(max(sizes), cfg.disk_point_bytes)))
    buffer[:] = np.random.default_rng(1).integers(0, 256, buffer.nbytes, dtype=np.uint8)
    out = []
    try:
        with open(path, "wb") as f:
            f.truncate(cfg.disk_bytes)
        files = {name: open_disk_file(path, engine=name) for name in engines}
        raw: RawDirect | None = None
        try:
            _fill(files[engines[0]], path, buffer, cfg.disk_bytes)
            try:
                raw = RawDirect(path, depth)
            except OSError as exc:
                notes.append(
                    f"raw O_DIRECT baseline skipped: the filesystem refuses O_DIRECT ({exc.strerror})"
                )
            for name, f in files.items():
                mode = "O_DIRECT" if f.direct else "buffered (page cache dropped before reads)"
                notes.append(f"{name}: {mode}, queue depth {depth}, pieces of {chunk_bytes() // MiB} MiB")
            for size in sizes:
                total = min(cfg.disk_bytes, max(size, min(size * 1024, cfg.disk_point_bytes)))
                requests = [(i * size, buffer[i * size : (i + 1) * size]) for i in range(total // size)]
                n = len(requests)
                for write in (False, True):
                    link = "host->disk" if write else "disk->host"
                    if raw is not None:
                        t = _median_seconds(lambda w=write, r=requests: raw.run(r, w),
                                            warmup=cfg.warmup, repeats=cfg.repeats)  # fmt: skip
                        out.append(Measurement(link, "raw O_DIRECT", size, n * size, n, t))
                    for name, f in files.items():
                        t = _median_seconds(lambda f=f, w=write, r=requests: _engine_op(f, r, w, path),
                                            warmup=cfg.warmup, repeats=cfg.repeats)  # fmt: skip
                        out.append(Measurement(link, name, size, n * size, n, t))
            for name, f in files.items():
                out += _block_batches(f, name, path, buffer, cfg)
        finally:
            for f in files.values():
                f.close()
            if raw is not None:
                raw.close()
    finally:
        path.unlink(missing_ok=True)
    return out, notes


LAYER_COPY_BLOCKS = 16  # memory copied between two batches: a layer's other blocks, as in a decode step


def _block_batches(f: DiskFile, name: str, path: Path, buffer: np.ndarray, cfg: BenchConfig) -> list[Measurement]:
    """disk->host as the disk tier reads during a decode step: one batch of ``k`` block-sized requests at
    scattered slots (a layer's disk blocks), for ``k`` = 1..64; each timed batch reads other slots. In a step
    the disk tier never reads back to back: between two layers' batches the mover copies the layers' other
    blocks, so an untimed copy of :data:`LAYER_COPY_BLOCKS` blocks precedes every timed batch (back-to-back
    batches read 7-15 % faster on the VM of docs/benchmarks.md)."""
    block = cfg.block_bytes - cfg.block_bytes % ALIGN
    slots = cfg.disk_bytes // block
    rng = np.random.default_rng(2)
    source = torch.ones(LAYER_COPY_BLOCKS * block, dtype=torch.uint8)
    copy = torch.empty_like(source)
    out = []
    for k in (1, 2, 4, 8, 16, 32, 64):
        if k > min(slots, buffer.nbytes // block):
            break
        views = [buffer[i * block : (i + 1) * block] for i in range(k)]

        def batch(k: int = k, views: list[np.ndarray] = views) -> float:
            offsets = rng.choice(slots, size=k, replace=False) * block
            requests = list(zip((int(o) for o in offsets), views))
            copy.copy_(source)  # untimed: the layer's memory copies before its disk batch
            return _seconds(lambda: _engine_op(f, requests, False, path))

        for _ in range(cfg.warmup):
            batch()
        inner = max(1, 16 // k)
        t = statistics.median(sum(batch() for _ in range(inner)) / inner for _ in range(max(cfg.repeats, 5)))
        out.append(Measurement("disk->host", f"{name} block batch", k * block, k * block, 1, t))
    return out


def _fill(f: DiskFile, path: Path, buffer: np.ndarray, disk_bytes: int) -> None:
    """Write real data over the whole file: holes and fallocated extents read as zeros without disk I/O."""
    step = buffer.nbytes - buffer.nbytes % ALIGN
    f.submit_writes(
        [(off, buffer[: min(step, disk_bytes - off)]) for off in range(0, disk_bytes, step)]
    ).wait()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _engine_op(f: DiskFile, requests: list[tuple[int, np.ndarray]], write: bool, path: Path) -> None:
    """One timed batch. Buffered engines get their cache dropped (reads) or fsync'd (writes) so the
    number is the disk's, not the page cache's."""
    if not f.direct and not write:
        _drop_page_cache(path)
    handle = f.submit_writes(requests) if write else f.submit_reads(requests)
    handle.wait()
    if not f.direct and write:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _slowdowns(job: Callable[[], None], unit: Callable[[], object], cfg: BenchConfig) -> tuple[float, float]:
    """How much compute (``unit`` repeated on the calling thread) and ``job`` (on a second thread, as the mover
    runs it) slow each other.

    The compute is ``unit`` repeated to last about as long as one job. Each sample times both alone, then
    the compute while the mover repeats the job the whole time, then one job while the compute repeats the
    whole time. Each side is measured under full overlap because that is what the model stretches; a single
    "together" time would hide the slowdown of whichever side ends first. Returns the medians over at least
    :data:`CONTENTION_SAMPLES` samples of (compute beside the job / alone, job beside compute / alone), each
    clamped to [1, MAX_SLOWDOWN].
    """
    reps = max(1, round(_median_seconds(job, warmup=cfg.warmup, repeats=cfg.repeats)
                        / _median_seconds(unit, warmup=cfg.warmup, repeats=cfg.repeats)))

    def compute() -> None:
        for _ in range(reps):
            unit()

    compute_ratios, job_ratios = [], []
    with cf.ThreadPoolExecutor(max_workers=1) as mover:
        for _ in range(max(CONTENTION_SAMPLES, cfg.repeats)):  # each sample is short and noisy: take more
            compute_alone, job_alone = _seconds(compute), _seconds(job)
            started, stop = threading.Event(), threading.Event()

            def repeat_job(started: threading.Event = started, stop: threading.Event = stop) -> None:
                started.set()
                while not stop.is_set():
                    job()

            repeating = mover.submit(repeat_job)
            started.wait()
            compute_beside = _seconds(compute)
            stop.set()
            repeating.result()
            running = mover.submit(_seconds, job)
            while not running.done():
                unit()
            compute_ratios.append(compute_beside / compute_alone)
            job_ratios.append(running.result() / job_alone)
    return tuple(min(MAX_SLOWDOWN, max(1.0, statistics.median(r))) for r in (compute_ratios, job_ratios))


DISK_CONTENTION_BATCH = 4  # blocks per read batch: a layer's disk blocks in a decode step


def measure_contention(cfg: BenchConfig, disk_engine: str | None,
                       compute: Callable[[], object] | None = None) -> Contention:
    """How the mover's work and compute slow each other on this CPU host (:func:`_slowdowns`).

    Two mover jobs: the store's gather (``KVStore.read_into`` of ``contention_bytes`` of one layer from
    device-tier blocks, walking a pool 4x that size, as :func:`measure_store_gather` and the executors do)
    and, with a ``disk_engine``, the disk tier's reads (batches of :data:`DISK_CONTENTION_BATCH` scattered
    block-sized requests, ``contention_bytes`` in all, from a file 4x that size: the engine's I/O threads
    and completions need the cores the compute holds). ``compute`` is one unit of the work to measure
    against, e.g. one decode step of your model; the default, a matrix-vector product over
    ``contention_bytes`` of weights, is decode's most memory-bound kernel, so its slowdown is an upper bound
    for a real model's."""
    unit = compute or _matrix_vector(cfg.contention_bytes)
    with _store_gather_job(cfg) as gather:
        compute_by_copies, copies_by_compute = _slowdowns(gather, unit, cfg)
    if disk_engine is None:
        return Contention(compute_by_copies, copies_by_compute)
    with _disk_reads(cfg, disk_engine) as reads:
        compute_by_disk, disk_by_compute = _slowdowns(reads, unit, cfg)
    return Contention(compute_by_copies, copies_by_compute, compute_by_disk, disk_by_compute)


def _matrix_vector(nbytes: int) -> Callable[[], object]:
    weights = torch.ones(nbytes // 4 // 1024, 1024)  # fp32 [rows, 1024]
    vector = torch.ones(1024)
    return lambda: torch.mv(weights, vector)


@contextlib.contextmanager
def _store_gather_job(cfg: BenchConfig) -> Iterator[Callable[[], None]]:
    """A job that gathers ``contention_bytes`` of one layer from device-tier blocks as the executors do."""
    block_tokens = _block_tokens(cfg)
    layer_tokens = max(block_tokens, cfg.contention_bytes // KV_TOKEN_BYTES // block_tokens * block_tokens)
    pool_tokens = 4 * layer_tokens
    slack = 4 * block_tokens * KV_TOKEN_BYTES
    store = _bench_store(cfg, pool_tokens * KV_TOKEN_BYTES + slack, slack)
    kv = _kv(pool_tokens)
    store.append(0, kv, kv)
    del kv
    plans = itertools.cycle([store.plan_read(0, start, start + layer_tokens)
                             for start in range(0, pool_tokens - layer_tokens + 1, layer_tokens)])
    staging = torch.empty(2, 1, KV_HEADS, layer_tokens, HEAD_DIM, dtype=KV_DTYPE)
    try:
        yield lambda: store.read_into(0, next(plans), staging)
    finally:
        store.close()


@contextlib.contextmanager
def _disk_reads(cfg: BenchConfig, engine: str) -> Iterator[Callable[[], None]]:
    """A job that reads ``contention_bytes`` through ``engine`` as the disk tier does in a decode step."""
    cfg.directory.mkdir(parents=True, exist_ok=True)
    path = cfg.directory / f"tierkv-bench-contention-{os.getpid()}.bin"
    block = cfg.block_bytes - cfg.block_bytes % ALIGN
    file_bytes = 4 * cfg.contention_bytes // block * block
    buffer = aligned_empty(min(file_bytes, max(cfg.contention_bytes, DISK_CONTENTION_BATCH * block)))
    buffer[:] = np.random.default_rng(3).integers(0, 256, buffer.nbytes, dtype=np.uint8)
    rng = np.random.default_rng(4)
    batches = max(1, cfg.contention_bytes // (DISK_CONTENTION_BATCH * block))
    views = [buffer[i * block : (i + 1) * block] for i in range(DISK_CONTENTION_BATCH)]
    try:
        with open(path, "wb") as f:
            f.truncate(file_bytes)
        disk_file = open_disk_file(path, engine=engine)
        try:
            _fill(disk_file, path, buffer, file_bytes)

            def reads() -> None:
                for _ in range(batches):
                    offsets = rng.choice(file_bytes // block, size=DISK_CONTENTION_BATCH, replace=False) * block
                    _engine_op(disk_file, list(zip((int(o) for o in np.sort(offsets)), views)), False, path)

            yield reads
        finally:
            disk_file.close()
    finally:
        path.unlink(missing_ok=True)


OVERHEAD_LAYERS, OVERHEAD_BLOCKS, OVERHEAD_STEPS = 8, 16, 20


def measure_layer_overhead(cfg: BenchConfig) -> float:
    """``LinkProfile.layer_overhead_s``: the cache's own work per layer on the compute thread, on the runtime's
    code. The exact-gather executor with layer-ahead prefetch runs decode steps over a device-tier store of
    :data:`OVERHEAD_LAYERS` layers of :data:`OVERHEAD_BLOCKS` blocks, one token appended per layer per step
    and no model; from its own telemetry, the time in ``gather`` outside the waits for prefetches (the
    bookkeeping, the read of the newest token, submitting the next prefetch), per layer, median over steps."""
    from tierkv.attention.exact_gather import ExactGather
    from tierkv.mover import ThreadMover
    from tierkv.stats import Timeline

    block_tokens = _block_tokens(cfg)
    tokens = OVERHEAD_BLOCKS * block_tokens
    budget = OVERHEAD_LAYERS * (OVERHEAD_BLOCKS + 2) * block_tokens * KV_TOKEN_BYTES
    store = _bench_store(cfg, budget + 4 * tokens * KV_TOKEN_BYTES, 0)
    kv, token = _kv(tokens), _kv(1)
    for layer in range(OVERHEAD_LAYERS):
        store.append(layer, kv, kv)
    executor = ExactGather(store, ThreadMover(), 1, timeline=Timeline(LinkProfile({}), "tierkv bench"))
    try:
        with torch.inference_mode():
            for _ in range(OVERHEAD_STEPS + 2):
                for layer in range(OVERHEAD_LAYERS):
                    store.append(layer, token, token)
                    executor.gather(layer, 0)
        steps = [step for step in executor.timeline.completed() if step.decode][-OVERHEAD_STEPS:]
        return statistics.median((step.wall_s - step.compute_s - step.stall_s) / OVERHEAD_LAYERS for step in steps)
    finally:
        executor.close()
        executor.mover.close()
        store.close()


# --------------------------------------------------------------------------- profile


def _fit(name: str, rows: Sequence[Measurement]) -> Link | str:
    """Fit per-transfer latency and bandwidth; the reason instead if the series cannot separate them.

    Rows whose transfers all have the row's size (disk requests, single copies) are fitted per transfer;
    a per-block gather row moves ``nbytes`` in ``transfers`` block copies of one size, so its total time is
    fitted against its total bytes (the latency is then per gather, and the per-block cost is in the slope).
    """
    if len({m.size for m in rows}) < 2:
        return f"{name}: fewer than 2 transfer sizes measured"
    per_transfer = all(m.nbytes == m.size * m.transfers for m in rows)
    sizes = [m.size if per_transfer else m.nbytes for m in rows]
    seconds = [m.seconds / m.transfers if per_transfer else m.seconds for m in rows]
    try:
        return fit_link(name, sizes, seconds)
    except ValueError as exc:
        return f"{name}: not fitted ({exc})"


def build_profile(
    measurements: Sequence[Measurement], machine: dict[str, str], disk_engine: str | None,
    contention: Contention | None = None, layer_overhead_s: float = 0.0,
) -> tuple[LinkProfile, list[str]]:
    """Fit the profile's links from the series the runtime will actually use.

    disk links come from the engine auto-selection picks (``disk_engine``); on CUDA the PCIe links from
    pinned copies (the host tier is pinned); without CUDA host->device and device->host are the memcpy,
    the mover is one thread (``serial_mover``), ``contention`` (:func:`measure_contention`) says how much
    its copies and disk reads and compute slow each other and ``layer_overhead_s``
    (:func:`measure_layer_overhead`) is the cache's own work per layer on the compute thread.
    """

    def rows(link: str, method: str) -> list[Measurement]:
        return [m for m in measurements if m.link == link and m.method == method]

    # what the executors' gathers do; per-block copies where the store series was not measured (small sizes)
    gather = rows("device->device", "store read_into") or rows("device->device", "gather per-block copy_")
    sources = {"host->host": rows("host->host", "memcpy"), "device->device": gather}
    if torch.cuda.is_available():
        sources["host->device"] = rows("host->device", "pinned")
        sources["device->host"] = rows("device->host", "pinned")
    else:  # the "device" is CPU memory: host blocks are copied into staging like device blocks
        sources["host->device"] = rows("host->device", "store read_into") or gather
        sources["device->host"] = sources["host->host"]
    if disk_engine is not None:  # reads: the per-layer batches of blocks the disk tier issues, when measured
        sources["disk->host"] = rows("disk->host", f"{disk_engine} block batch") or rows("disk->host", disk_engine)
        sources["host->disk"] = rows("host->disk", disk_engine)
        machine = {**machine, "disk_engine": disk_engine}
    fits = {key: _fit(key, series) for key, series in sources.items()}
    links = {key: fit for key, fit in fits.items() if isinstance(fit, Link)}
    notes = [fit for fit in fits.values() if isinstance(fit, str)]
    if torch.cuda.is_available():
        return LinkProfile(links, machine), notes
    return LinkProfile(links, machine, serial_mover=True, contention=contention or Contention(),
                       layer_overhead_s=layer_overhead_s), notes


def run_bench(cfg: BenchConfig, *, progress: Callable[[str], None] = lambda _: None,
              compute: Callable[[], object] | None = None) -> BenchResult:
    """Measure every link of this host and fit the profile; ``compute``: see :func:`measure_contention`."""
    sizes = transfer_sizes(cfg.min_size, cfg.max_size)
    machine = machine_description(cfg.directory)
    measurements: list[Measurement] = []
    progress("host memcpy")
    measurements += measure_memcpy(sizes, cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    progress(f"block gather ({device})")
    measurements += measure_gather(sizes, cfg, device)
    measurements += measure_store_gather(sizes, cfg, device)
    if device == "cuda":
        progress("host<->device copies")
        measurements += measure_cuda_links(sizes, cfg)
    progress(f"disk ({cfg.disk_bytes // MiB} MiB file in {cfg.directory})")
    disk_rows, notes = measure_disk(sizes, cfg)
    measurements += disk_rows
    engines = list(cfg.engines) if cfg.engines is not None else available_engines()
    disk_engine = next((e for e in available_engines() if e in engines), None)
    contention, overhead = None, 0.0
    if device == "cpu":
        progress("copies and disk reads beside compute (contention), the cache's own work per layer")
        contention = measure_contention(cfg, disk_engine, compute)
        overhead = measure_layer_overhead(cfg)
    profile, fit_notes = build_profile(measurements, machine, disk_engine, contention, overhead)
    return BenchResult(measurements, profile, machine, notes + fit_notes)


# --------------------------------------------------------------------------- plot


def plot(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """Bandwidth vs transfer size, one panel per family of links."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "memory": ("host->host", "device->device", "host->device", "device->host", "host<->device"),
        "disk read": ("disk->host",),
        "disk write": ("host->disk",),
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), constrained_layout=True)
    for ax, (title, links) in zip(axes, panels.items(), strict=True):
        series = sorted({(m.link, m.method) for m in result.measurements if m.link in links})
        for link, method in series:
            rows = result.series(link, method)
            ax.plot([m.size for m in rows], [m.gbps for m in rows], marker="o", label=f"{link} {method}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("transfer size (bytes per request / copy)")
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    m = result.machine
    fig.suptitle(
        f"tierkv bench: {m['cpu']}, {m['cores']}, GPU {m['gpu']}, {m['filesystem']}, {m['date']}", fontsize=9
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
