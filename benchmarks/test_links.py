"""Memory-link benchmarks: host memcpy, block gather into the device tier vs a plain copy, PCIe copies.

``test_gather_ratio`` prints gather / plain-copy bandwidth measured side by side: what assembling a
layer's KV from scattered slots costs over copying the same bytes contiguously.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.table import Table

from tierkv.calibrate import median_seconds

MiB = 1 << 20
BLOCK = 256 * 1024  # bytes per block of one layer
TOTAL = 64 * MiB  # bytes gathered per call (one layer's KV of a long context)


def _gather_setup(device: str = "cpu"):
    k = TOTAL // BLOCK
    pool = torch.ones(2 * k, BLOCK, dtype=torch.uint8, device=device)  # [slots, block bytes]
    staging = torch.empty(k, BLOCK, dtype=torch.uint8, device=device)  # [k, block bytes]
    slots = torch.from_numpy(np.random.default_rng(0).permutation(2 * k)[:k]).to(device)
    return pool, staging, slots


@pytest.mark.parametrize("size", [64 * 1024, MiB, 64 * MiB])
def test_memcpy(benchmark, size: int) -> None:
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)


def _gather_ops() -> dict:
    """The same bytes moved three ways: one plain copy, one index_select, one copy per block."""
    pool, staging, slots = _gather_setup()
    slot_list = slots.tolist()

    def per_block() -> None:
        for i, slot in enumerate(slot_list):
            staging[i].copy_(pool[slot])

    return {
        "plain copy": lambda: staging.copy_(pool[: len(slot_list)]),
        "index_select": lambda: torch.index_select(pool, 0, slots, out=staging),
        "per-block copy_": per_block,
    }


@pytest.mark.parametrize("method", ["plain copy", "index_select", "per-block copy_"])
def test_gather(benchmark, method: str) -> None:
    benchmark(_gather_ops()[method])


def test_gather_ratio(capsys) -> None:
    ops = _gather_ops()
    gbps = {name: TOTAL / median_seconds(op, warmup=2, repeats=9) / 1e9 for name, op in ops.items()}
    table = Table(
        title=f"gather of {TOTAL // BLOCK} blocks of {BLOCK >> 10} KiB ({torch.get_num_threads()} threads)"
    )
    for column in ("method", "GB/s", "/ plain copy"):
        table.add_column(column, justify="right")
    for name, value in gbps.items():
        table.add_row(name, f"{value:.2f}", f"{value / gbps['plain copy']:.2f}")
    with capsys.disabled():
        Console(width=132).print(table)
    assert all(v > 0 for v in gbps.values())


@pytest.mark.cuda
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pcie_copy(benchmark, pinned: bool, direction: str) -> None:
    host = torch.ones(256 * MiB, dtype=torch.uint8)
    if pinned:
        host = host.pin_memory()
    device = torch.empty_like(host, device="cuda")

    def copy() -> None:
        if direction == "h2d":
            device.copy_(host, non_blocking=True)
        else:
            host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()  # the copy is only done when the stream is

    benchmark(copy)
