"""Disk benchmarks: each engine beside a raw O_DIRECT loop, reading and writing the same file.

Every timed operation is one batch over the whole data file in ``TIERKV_BENCH_REQUEST``-byte requests,
so the queue stays full. ``test_disk_ratios`` measures all of them side by side in one run (same file,
same moment, interleaved) and prints engine/raw ratios: the number that says whether an engine costs
anything over what the filesystem gives a bare program.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from rich.console import Console
from rich.table import Table

from tierkv.calibrate import RawDirect, median_seconds
from tierkv.io import aligned_empty, available_engines, open_disk_file
from tierkv.io.base import queue_depth

METHODS = ["raw O_DIRECT", *available_engines()]


def _batch(request_size: int, disk_size: int) -> list:
    buffer = aligned_empty(disk_size)
    return [
        (off, buffer[off : off + request_size])
        for off in range(0, disk_size - request_size + 1, request_size)
    ]


def _operation(method: str, path: Path, write: bool, requests: list):
    """Return (op, close) for one method; engines are opened with O_DIRECT so reads hit the disk."""
    if method == "raw O_DIRECT":
        raw = RawDirect(path, queue_depth())
        return (lambda: raw.run(requests, write)), raw.close
    f = open_disk_file(path, engine=method, direct=True)
    submit = f.submit_writes if write else f.submit_reads
    return (lambda: submit(requests).wait()), f.close


@pytest.mark.parametrize("direction", ["read", "write"])
@pytest.mark.parametrize("method", METHODS)
def test_disk(
    benchmark, data_file: Path, disk_size: int, request_size: int, method: str, direction: str
) -> None:
    requests = _batch(request_size, disk_size)
    op, close = _operation(method, data_file, direction == "write", requests)
    try:
        benchmark.pedantic(op, rounds=5, warmup_rounds=1)
    finally:
        close()
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["GB/s"] = round(disk_size / benchmark.stats.stats.median / 1e9, 3)


def test_disk_ratios(data_file: Path, disk_size: int, request_size: int, capsys) -> None:
    """Side by side in one run: median GB/s of every method, and engine / raw."""
    requests = _batch(request_size, disk_size)
    table = Table(
        title=f"disk, {disk_size >> 20} MiB in {request_size >> 10} KiB requests, QD {queue_depth()}"
    )
    for column in ("direction", *METHODS):
        table.add_column(column, justify="right")
    for write in (False, True):
        gbps = {}
        for method in METHODS:
            op, close = _operation(method, data_file, write, requests)
            try:
                gbps[method] = disk_size / median_seconds(op, warmup=1, repeats=5) / 1e9
            finally:
                close()
        raw = gbps["raw O_DIRECT"]
        cells = [
            f"{gbps[m]:.2f}" + ("" if m == "raw O_DIRECT" else f" ({gbps[m] / raw:.2f})") for m in METHODS
        ]
        table.add_row("write" if write else "read", *cells)
        assert all(v > 0 for v in gbps.values())
    with capsys.disabled():
        Console(width=132).print(table)


IN_FLIGHT = [(1, 2), (2, 2), (3, 2), (4, 2), (6, 2), (8, 2), (4, 4), (8, 4), (16, 4)]  # (queue depth, MiB per request)


def test_read_rate_against_bytes_in_flight(data_file: Path, disk_size: int, capsys) -> None:
    """Raw O_DIRECT reads of the whole file at several queue depths and request sizes, side by side: GB/s against
    the bytes in flight (depth x request). By Little's law a reader holding less than bandwidth x latency in flight
    cannot reach the disk's rate; this table says how much a bounded set of bounce buffers leaves on the table."""
    rates = {}
    for depth, mib in IN_FLIGHT:
        raw = RawDirect(data_file, depth)
        try:
            read = functools.partial(raw.run, _batch(mib << 20, disk_size), False)
            rates[depth, mib] = disk_size / median_seconds(read, warmup=1, repeats=3) / 1e9
        finally:
            raw.close()
    best = max(rates.values())
    table = Table(title=f"raw O_DIRECT read of {disk_size >> 20} MiB against bytes in flight")
    for column in ("in flight", "depth x request", "GB/s", "of the best"):
        table.add_column(column, justify="right")
    for (depth, mib), rate in sorted(rates.items(), key=lambda item: (item[0][0] * item[0][1], item[0][1])):
        table.add_row(f"{depth * mib} MiB", f"{depth} x {mib} MiB", f"{rate:.2f}", f"{rate / best:.2f}")
    with capsys.disabled():
        Console(width=132).print(table)
    assert all(rate > 0 for rate in rates.values())
