"""The host attention kernel's read bandwidth beside the host's, for the same bytes, in one run.

A Llama-3-8B-shaped layer (8 kv heads, head_dim 128, 32 query heads, one decode query) lies in a host slab as
a memory tier holds it (blocks ``[2, H_kv, block_tokens, D]`` in slots); the kernel attends it through a block
table (shuffled runs of consecutive slots, as a tier fills), and the same slab bytes are read by a plain
``torch.sum`` and copied by a plain ``copy_`` (memcpy), on 1 and 2 threads. ``test_host_kernel_ratio``
prints GB/s of K/V attended per second and the ratios (issue target: >= 0.8 of the plain read) for 8K-1M
tokens (``TIERKV_BENCH_HOST_TOKENS``: the largest, default 1048576 = 4 GiB per layer in fp16, 8 GiB with
the copy's destination; lower it on a small host). ``test_host_kernel`` is the pytest-benchmark timing of one size.
These are wall-clock rates; on a shared, loaded host ``benchmarks/host_kernel_cpu_time.py`` measures the same
comparison in process CPU time (and for each of the kernel's code paths).

    pytest benchmarks/test_host_kernel.py --benchmark-enable -s
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console
from rich.table import Table

from tierkv.attention import host_kernel
from tierkv.calibrate import median_seconds
from tierkv.inputs import env_str
from tierkv.layout import BlockLayout

KV_HEADS, HEAD_DIM, Q_HEADS = 8, 128, 32  # Llama-3-8B
BLOCK_TOKENS = 256  # the cache's default
RUN_BLOCKS = 64  # slots a tier hands out consecutively before a row's blocks jump elsewhere
TARGET = 0.8


def _tokens() -> list[int]:
    top = int(env_str("TIERKV_BENCH_HOST_TOKENS", str(1 << 20)))
    sizes = [8 << 10, 64 << 10, 256 << 10, 1 << 20]
    return [t for t in sizes if t <= top] or [top]


def _layer(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, torch.Tensor]:
    """(raw slab [slots, slot_bytes], its block view, a block table of shuffled runs, one decode query)."""
    layout = BlockLayout(KV_HEADS, HEAD_DIM, BLOCK_TOKENS, dtype)
    n = -(-tokens // BLOCK_TOKENS)
    raw = torch.empty((n, layout.slot_bytes), dtype=torch.uint8)
    blocks = layout.blocks_of(raw)
    for start in range(0, n, RUN_BLOCKS):  # fill in pieces: no fp32 temporary of the whole layer
        blocks[start : start + RUN_BLOCKS] = torch.randn(blocks[start : start + RUN_BLOCKS].shape).to(dtype)
    runs = np.arange(n).reshape(-1, 1) if n < RUN_BLOCKS else np.arange(n // RUN_BLOCKS * RUN_BLOCKS).reshape(
        -1, RUN_BLOCKS)  # fmt: skip
    order = np.random.default_rng(0).permutation(len(runs))
    table = np.concatenate([runs[order].ravel(), np.arange(runs.size, n)])[None]
    query = torch.randn(1, Q_HEADS, 1, HEAD_DIM)
    return raw, blocks, table, query


def _ops(tokens: int, dtype: torch.dtype, threads: int) -> tuple[int, dict]:
    raw, blocks, table, query = _layer(tokens, dtype)
    copy = torch.empty_like(raw)
    flat = raw.view(-1).view(dtype)  # the same bytes as one contiguous tensor: the fastest plain read
    scaling = HEAD_DIM**-0.5

    def attend() -> None:
        host_kernel.paged_attention(query, blocks, table, tokens, scaling=scaling, threads=threads)

    def read() -> None:
        with _torch_threads(threads):
            flat.sum()

    def memcpy() -> None:
        with _torch_threads(threads):
            copy.copy_(raw)

    kv_bytes = tokens * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    return kv_bytes, {"host kernel": attend, "torch sum": read, "memcpy": memcpy}


class _torch_threads:
    def __init__(self, threads: int) -> None:
        self.threads = threads

    def __enter__(self) -> None:
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved)


@pytest.fixture(scope="module", autouse=True)
def _kernel_loads() -> None:
    if not host_kernel.available():
        pytest.skip(f"the C kernel does not load here: {host_kernel._build()}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_host_kernel(benchmark, dtype: torch.dtype, threads: int) -> None:
    _, ops = _ops(64 << 10, dtype, threads)
    benchmark(ops["host kernel"])


def test_host_kernel_ratio(capsys) -> None:
    """GB/s of K/V attended beside a plain read and a copy of the same slab, side by side per size."""
    table = Table(title=f"host attention kernel, Llama-3-8B layer (H_kv={KV_HEADS}, D={HEAD_DIM}, H_q={Q_HEADS}, "
                        f"block {BLOCK_TOKENS}), one decode query")  # fmt: skip
    for column in ("tokens", "dtype", "threads", "kernel GB/s", "sum GB/s", "memcpy GB/s", "kernel / sum",
                   "kernel / memcpy"):  # fmt: skip
        table.add_column(column, justify="right")
    ratios = []
    for tokens in _tokens():
        for dtype in (torch.float16, torch.bfloat16):
            for threads in (1, 2):
                kv_bytes, ops = _ops(tokens, dtype, threads)
                repeats = 3 if tokens >= 256 << 10 else 7
                gbps = {name: kv_bytes / median_seconds(op, warmup=1, repeats=repeats) / 1e9
                        for name, op in ops.items()}  # fmt: skip
                del ops
                ratio = gbps["host kernel"] / gbps["torch sum"]
                ratios.append(ratio)
                table.add_row(f"{tokens >> 10}K", str(dtype).removeprefix("torch."), str(threads),
                              f"{gbps['host kernel']:.1f}", f"{gbps['torch sum']:.1f}", f"{gbps['memcpy']:.1f}",
                              f"{ratio:.2f}", f"{gbps['host kernel'] / gbps['memcpy']:.2f}")  # fmt: skip
    with capsys.disabled():
        Console(width=140).print(table)
        print(f"target: kernel >= {TARGET} x the plain read; met in {sum(r >= TARGET for r in ratios)} of "
              f"{len(ratios)} rows")  # fmt: skip
    assert all(r > 0 for r in ratios)
