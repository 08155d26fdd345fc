"""Where split's decode step goes with most of the KV on disk: wall time, the main thread's CPU time, and the time
inside each stage of a disk round, per step.

    python benchmarks/split_disk_profile.py            # TIERKV_BENCH_DIR: the disk tier's directory

The model, placement and budgets of ``test_scale.py::test_disk_reads_overlap_compute`` (8K tokens, 512 MiB of KV,
about 80% of the blocks on disk, ~200 MB of budgets), one torch thread. Each stage is timed by wrapping its
function (a few microseconds each), after warm-up steps; the figures are per decode step, with the calls per
step. When the main thread's CPU time is close to the wall time, the step is bound by the CPU work on that thread
(submitting, verifying and attending rounds), not by the disk; all threads' CPU time against the wall time times
the cores says how busy the host was, and the executor's stall how long the main thread waited for disk rounds.
The disk's own counters (``/proc/diskstats`` of the device under the directory) say how much of the wall time it
had a read in flight and how fast it read meanwhile: idle time is what deeper reads ahead could fill.
With the native engine and the C kernel a layer's rounds run in one C loop (``_DiskRead.consume_rounds``); the
Python loop's stages appear only where it runs instead. Last, what a round's Python costs right after a
kernel-sized stream of memory: the request arithmetic of one round (``tierkv.tiers.disk._runs``) after a sum over
a fresh 2 MiB, against the same in a loop.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import test_scale as scale
import torch

from tierkv import TieredCache
from tierkv.attention import host_kernel, split
from tierkv.inputs import env_str
from tierkv.tiers import disk

WARMUP, STEPS = 3, 5
STAGES: list[tuple[object, str, str]] = [  # (owner, attribute, label), outermost first
    (split.SplitAttention, "attend", "attend (a layer)"),
    (split.SplitAttention, "_attend_memory", "  memory tiers' share: one kernel call"),
    (split.SplitAttention, "_attend_rounds", "  disk share: its rounds"),
    (split._DiskShare, "attend_all", "    all rounds in one C loop (packing included)"),
    (disk._DiskRead, "consume_rounds", "      the C loop: wait, verify, kernel per round"),
    (disk._DiskRead, "_submit", "    submit a round (from Python: the ring's first ones)"),
    (disk.DiskTier, "wait", "    wait for a round (Python loop)"),
    (disk.DiskSlotFile, "verify", "    verify a round (Python loop)"),
    (split._DiskShare, "attend", "    attend a round (Python loop)"),
    (host_kernel.PagedCall, "__call__", "      prepared kernel call (Python loop and memory share)"),
]


def _timed(totals: collections.Counter, calls: collections.Counter, label: str,
           function: Callable) -> Callable:  # fmt: skip
    def wrapper(*args, **kwargs):
        begun = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - begun
            calls[label] += 1
    return wrapper


def _disk_counters(directory: Path) -> tuple[int, int] | None:
    """(bytes read, milliseconds with I/O in flight) of the block device holding ``directory``, from
    /proc/diskstats (None where there is none: not Linux, or a filesystem without one)."""
    device = os.stat(directory).st_dev
    with contextlib.suppress(OSError), open("/proc/diskstats") as table:
        for line in table:
            fields = line.split()
            if (int(fields[0]), int(fields[1])) == (os.major(device), os.minor(device)):
                return int(fields[5]) * 512, int(fields[12])
    return None


def _after_streaming(rounds: int = 200) -> tuple[float, float]:
    """Seconds of one ``_runs`` call right after a sum over a fresh 2 MiB (a round's kernel call streams that much
    through the caches), and in a loop."""
    slots = np.array([5, 9], dtype=np.int64)
    memory = np.ones((rounds, 2 * 2**20), dtype=np.uint8)
    cold = warm = 0.0
    for row in memory:
        row.sum(dtype=np.uint64)
        begun = time.perf_counter()
        disk._runs(slots)
        cold += time.perf_counter() - begun
    for _ in range(rounds):
        begun = time.perf_counter()
        disk._runs(slots)
        warm += time.perf_counter() - begun
    return cold / rounds, warm / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     epilog="$TIERKV_BENCH_DIR: the disk tier's directory (default: the temporary "
                                            "directory). It takes no arguments.")
    parser.parse_args()
    torch.set_num_threads(1)
    config = scale._disk_config()
    model, token = scale._model(config)
    gpu = TieredCache.min_device_bytes(config, scale.DISK_CONTEXT + 256, block_tokens=scale.DISK_BLOCK)
    gpu += scale.DISK_KV // 16
    directory = Path(env_str("TIERKV_BENCH_DIR", tempfile.gettempdir()))
    totals: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for owner, attribute, label in STAGES:
        setattr(owner, attribute, _timed(totals, calls, label, getattr(owner, attribute)))
    with tempfile.TemporaryDirectory(dir=directory) as folder, \
            TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{scale.DISK_KV // 8}B", disk_dir=folder,
                        block_tokens=scale.DISK_BLOCK, config=config) as cache:  # fmt: skip
        scale._fill([cache], scale.DISK_LAYERS, scale.DISK_HEADS, scale.DISK_DIM, scale.DISK_CONTEXT, 512)
        with cache.split(model):  # after the fill, as the benchmark places the blocks
            for _ in range(WARMUP):
                scale._step(model, cache, token)
            totals.clear()
            calls.clear()
            executor = cache.executors["split"]
            wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            stall, counted = executor.stall_s, _disk_counters(Path(folder))
            for _ in range(STEPS):
                scale._step(model, cache, token)
            wall, cpu = (time.perf_counter() - wall) / STEPS, (time.thread_time() - cpu) / STEPS
            process, stall = (time.process_time() - process) / STEPS, (executor.stall_s - stall) / STEPS
            after = _disk_counters(Path(folder))
        print(f"blocks {cache.stats()['blocks']}; per step: wall {wall * 1e3:.1f} ms, main thread CPU "
              f"{cpu * 1e3:.1f} ms, all threads' CPU {process * 1e3:.1f} ms ({os.cpu_count()} cores), waiting for "
              f"disk rounds {stall * 1e3:.1f} ms")
        if counted is not None and after is not None:
            read, busy = (after[0] - counted[0]) / STEPS, (after[1] - counted[1]) / STEPS / 1e3
            print(f"the disk (/proc/diskstats): {read / 2**20:.0f} MiB read per step, busy {busy / wall:.0%} of the "
                  f"wall time, {read / max(busy, 1e-9) / 1e9:.2f} GB/s while busy, {read / wall / 1e9:.2f} GB/s "
                  "overall")
    for _, _, label in STAGES:
        if calls[label]:
            print(f"{label:56s} {totals[label] / STEPS * 1e3:7.1f} ms  {calls[label] // STEPS:5d} calls "
                  f"{totals[label] / calls[label] * 1e6:7.1f} us each")
    cold, warm = _after_streaming()
    print(f"a round's request arithmetic: {cold * 1e6:.1f} us after streaming 2 MiB, {warm * 1e6:.1f} us in a loop")


if __name__ == "__main__":
    main()
