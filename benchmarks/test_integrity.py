"""What the disk tier's checksums cost: every block read back is verified (xxh3-64) before it is copied on.

    pytest benchmarks/test_integrity.py --benchmark-enable -s

``test_verified_layer_reads``: a layer's disk read through ``DiskTier.start_read(...).finish`` (O_DIRECT,
1 MiB blocks), 32 MiB (one batched engine call) and 128 MiB (rounds through the two halves of a 32 MiB
bounce buffer), with verification and with it switched off, interleaved in one run; prints the medians,
their ratio, and the hashing speed alone. ``test_verified_decode_step``: the decode step of
``benchmarks/test_scale.py``'s disk-overlap model (8K tokens, most KV on disk), exact gather, with and without
verification, interleaved in one run. Both print; nothing is asserted (the target lives in docs/reliability.md).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.table import Table
from test_scale import (
    DISK_BLOCK,
    DISK_CONTEXT,
    DISK_DIM,
    DISK_HEADS,
    DISK_KV,
    DISK_LAYERS,
    _disk_config,
    _fill,
    _interleaved,
    _model,
    _steps,
)

from tierkv import TieredCache
from tierkv.calibrate import machine_description
from tierkv.inputs import env_str
from tierkv.layout import BlockLayout
from tierkv.tiers import disk as disk_module
from tierkv.tiers.base import Scratch
from tierkv.tiers.disk import BounceBuffer, DiskSlotFile, DiskTier, checksums

MiB = 1 << 20
ROUNDS = 9


def _no_verify(self, slots, rows) -> None:
    return None


@pytest.fixture
def directory() -> Path:
    return Path(env_str("TIERKV_BENCH_DIR", tempfile.gettempdir()))


def test_verified_layer_reads(directory: Path, monkeypatch, capsys) -> None:
    layout = BlockLayout(8, 64, 256, torch.float32)  # 1 MiB blocks
    tier = DiskTier(directory, budget=256 * MiB)
    scratch = Scratch(BounceBuffer)
    slots = np.array([tier.alloc(layout.slot_bytes) for _ in range(128)], dtype=np.int64)
    tier.write_from(layout, slots, torch.randn(128, *layout.shape), scratch)
    out = torch.empty(128, *layout.shape)
    verify = DiskSlotFile.verify
    table = Table(title="a layer's disk read, O_DIRECT, 1 MiB blocks")
    for column in ("read", "verified", "unverified", "ratio", "verified GB/s"):
        table.add_column(column, justify="right")
    try:
        for count in (32, 128):
            def read(count=count) -> float:
                start = time.perf_counter()
                tier.start_read(layout, slots[:count], scratch).finish([(0, count, out[:count])])
                return time.perf_counter() - start

            times: dict[str, list[float]] = {"verified": [], "unverified": []}
            for _ in range(ROUNDS):
                for name in times:
                    monkeypatch.setattr(DiskSlotFile, "verify", verify if name == "verified" else _no_verify)
                    read()
                    times[name].append(read())
            monkeypatch.setattr(DiskSlotFile, "verify", verify)
            on, off = statistics.median(times["verified"]), statistics.median(times["unverified"])
            table.add_row(f"{count} MiB", f"{on * 1e3:.1f} ms", f"{off * 1e3:.1f} ms", f"{on / off:.3f}",
                          f"{count * MiB / on / 1e9:.2f}")
    finally:
        tier.close()
    rows = np.random.default_rng(0).integers(0, 256, (64, MiB), dtype=np.uint8)
    start = time.perf_counter()
    checksums(rows)
    hashing = rows.nbytes / (time.perf_counter() - start)
    with capsys.disabled():
        print("\n" + ", ".join(f"{k}: {v}" for k, v in machine_description(directory).items()))
        Console(width=150).print(table)
        print(f"xxh3-64 alone: {hashing / 1e9:.2f} GB/s on one thread; "
              f"BOUNCE_BYTES {disk_module.BOUNCE_BYTES >> 20} MiB")


def test_verified_decode_step(directory: Path, monkeypatch, capsys) -> None:
    config = _disk_config()
    model, token = _model(config)
    gpu = TieredCache.min_device_bytes(config, DISK_CONTEXT + 256, block_tokens=DISK_BLOCK) + DISK_KV // 16
    cache = TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{DISK_KV // 8}B", disk_dir=directory, block_tokens=DISK_BLOCK,
                        config=config)
    verify = DiskSlotFile.verify
    try:
        _fill([cache], DISK_LAYERS, DISK_HEADS, DISK_DIM, DISK_CONTEXT, 512)
        placed = cache.stats()["blocks"]
        run = _steps(model, cache, token)

        def toggled(on: bool):
            def steps(n: int) -> list[float]:
                monkeypatch.setattr(DiskSlotFile, "verify", verify if on else _no_verify)
                try:
                    return run(n)
                finally:
                    monkeypatch.setattr(DiskSlotFile, "verify", verify)
            return steps

        medians = _interleaved({"verified": toggled(True), "unverified": toggled(False)})
        for _ in range(3):  # the cache grew by the steps above: what was written since still verifies
            run(1)
    finally:
        cache.close()
    with capsys.disabled():
        print(f"\ndecode step, {DISK_CONTEXT:,} tokens, {DISK_KV >> 20} MiB of KV, blocks {placed}: verified "
              f"{medians['verified'] * 1e3:.1f} ms, unverified {medians['unverified'] * 1e3:.1f} ms, ratio "
              f"{medians['verified'] / medians['unverified']:.3f}")
