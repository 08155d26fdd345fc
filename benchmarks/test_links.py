"""Memory-link benchmarks: host memcpy, block gather into the device tier vs a plain copy, PCIe copies.

``test_gather_ratio`` prints gather / plain-copy bandwidth measured side by side: what assembling a
layer's KV from scattered slots costs over copying the same bytes contiguously. On a GPU,
``test_pcie_targets`` measures the store's own host->device read and device->host write of one layer's
256 MiB against a plain pinned copy of the same bytes, side by side, and asserts the targets
(:data:`STORE_TARGET` of the plain copy; pinned faster than pageable by :data:`PINNED_TARGET`).
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
STORE_TARGET = 0.9  # the store's host<->device copies reach this share of a plain pinned copy's GB/s
PINNED_TARGET = 1.2  # pinned copies beat pageable ones by at least this factor (else pinning is not in effect)
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


@pytest.mark.cuda
def test_pcie_targets(capsys) -> None:
    """One layer of 256 MiB (1,024 blocks of 256 KiB, bf16 [2, 8, 64, 128]) through the store's pinned host
    tier, against plain copies of the same bytes, measured side by side; the targets are asserted."""
    from tierkv.accel import backend
    from tierkv.blocks import Tier
    from tierkv.calibrate import median_cuda_seconds
    from tierkv.layout import BlockLayout
    from tierkv.tiers.base import Scratch
    from tierkv.tiers.disk import BounceBuffer
    from tierkv.tiers.memory import MemoryTier

    device = torch.device("cuda", torch.cuda.current_device())
    accel = backend(device)
    layout = BlockLayout(8, 128, 64, torch.bfloat16)
    count = 256 * MiB // layout.slot_bytes
    nbytes = count * layout.slot_bytes
    host = MemoryTier(Tier.HOST, 2 * nbytes, torch.device("cpu"), pin=True)
    slots = np.asarray([host.alloc(layout.slot_bytes) for _ in range(count)], dtype=np.int64)
    scratch = Scratch(lambda: BounceBuffer(pin=True, accel=accel), landing_bytes=32 * MiB, device=device, accel=accel)
    blocks = torch.randn((count, *layout.shape), device=device).to(torch.bfloat16)
    staging = torch.empty_like(blocks)
    host.write_from(layout, slots, blocks, scratch)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ops = {
        "store read (host->device)": lambda: host.start_read(layout, slots, scratch).finish([(0, count, staging)]),
        "plain pinned H2D": lambda: flat.copy_(pinned, non_blocking=True),
        "plain pageable H2D": lambda: flat.copy_(pageable, non_blocking=True),
        "store write (device->host)": lambda: host.write_from(layout, slots, blocks, scratch),
        "plain pinned D2H": lambda: pinned.copy_(flat, non_blocking=True),
        "plain pageable D2H": lambda: pageable.copy_(flat, non_blocking=True),
    }
    gbps = {name: nbytes / median_cuda_seconds(op, warmup=2, repeats=5) / 1e9 for name, op in ops.items()}
    host.start_read(layout, slots, scratch).finish([(0, count, staging)])
    torch.cuda.synchronize(device)
    assert torch.equal(staging, blocks)  # the timed path moved the right bytes
    table = Table(title=f"PCIe, {nbytes // MiB} MiB per call, {torch.cuda.get_device_name(device)}")
    for column in ("copy", "GB/s"):
        table.add_column(column, justify="right")
    for name, value in gbps.items():
        table.add_row(name, f"{value:.1f}")
    with capsys.disabled():
        Console(width=132).print(table)
    host.close()
    for direction, store in (("H2D", "store read (host->device)"), ("D2H", "store write (device->host)")):
        assert gbps[store] >= STORE_TARGET * gbps[f"plain pinned {direction}"], (direction, gbps)
        pinned, pageable = gbps[f"plain pinned {direction}"], gbps[f"plain pageable {direction}"]
        assert pinned >= PINNED_TARGET * pageable, (direction, gbps)
