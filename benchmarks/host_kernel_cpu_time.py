"""The host attention kernel's K/V read rate beside a plain read and a memcpy of the same slab, in CPU time.

Standalone (``python benchmarks/host_kernel_cpu_time.py``): a Llama-3-8B-shaped layer (8 kv heads, head_dim 128,
block 256) lies in a host slab as a memory tier holds it, in shuffled runs of 64 consecutive slots, and one
decode query attends it through its block table, beside ``torch.sum`` over the same bytes and a ``copy_`` of
them, for fp16 and bf16, 32 query heads (GQA group 4) and 8 (group 1), 1 and 2 threads. Each rate is bytes
of K/V per second of *process CPU time* divided by the threads (``time.process_time``): on a shared, loaded
host wall time measures the neighbours, CPU time the work. Every code path of the kernel the CPU has is
timed (``avx512``, ``avx2``, ``portable``), so one run shows what each brought. ``OMP_WAIT_POLICY`` defaults
to ``PASSIVE`` here, so that threads spinning between calls (the kernel's and torch's) are not counted as work.

    python benchmarks/host_kernel_cpu_time.py --tokens 8192 65536 --repeat 3
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP threads sleep: CPU time counts only work

import numpy as np
import torch

from tierkv.attention import host_kernel
from tierkv.layout import BlockLayout

KV_HEADS, HEAD_DIM, BLOCK_TOKENS, RUN_BLOCKS = 8, 128, 256, 64
WINDOW_S = 0.25


def layer(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """(raw slab [slots, slot_bytes], its block view, a block table of shuffled runs of slots)."""
    layout = BlockLayout(KV_HEADS, HEAD_DIM, BLOCK_TOKENS, dtype)
    n = -(-tokens // BLOCK_TOKENS)
    raw = torch.empty((n, layout.slot_bytes), dtype=torch.uint8)
    blocks = layout.blocks_of(raw)
    for start in range(0, n, RUN_BLOCKS):
        blocks[start : start + RUN_BLOCKS] = torch.randn(blocks[start : start + RUN_BLOCKS].shape).to(dtype)
    runs = np.array_split(np.arange(n), max(1, n // RUN_BLOCKS))
    order = np.random.default_rng(0).permutation(len(runs))
    return raw, blocks, np.concatenate([runs[i] for i in order])[None]


def cpu_rate(fn: Callable[[], object], nbytes: int, threads: int, repeat: int) -> float:
    """GB/s of ``nbytes`` per (process CPU second / threads): the best of ``repeat`` windows of at least
    ``WINDOW_S`` CPU seconds each, after a warm-up call. Long windows because the kernel adds another thread's
    CPU time to the process's only at a scheduler tick: one short call would under-count it."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        calls, start = 0, time.process_time()
        while (spent := time.process_time() - start) < WINDOW_S:
            fn()
            calls += 1
        best = min(best, spent / calls)
    return nbytes / (best / threads) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 65536])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    paths = list(range(int(host_kernel.library().tkv_attn_isa()), -1, -1))
    names = [f"kernel {host_kernel.ISAS[i]}" for i in paths]
    print(f"{'dtype':8} {'q heads':>7} {'tokens':>7} {'thr':>3} | " + " | ".join(f"{n:>16}" for n in names)
          + f" | {'torch.sum':>9} | {'memcpy':>9} | best/sum best/memcpy")  # fmt: skip
    for dtype in (torch.float16, torch.bfloat16):
        for tokens in args.tokens:
            for q_heads in (32, 8):
                for threads in args.threads:
                    row = measure(dtype, tokens, q_heads, threads, paths, args.repeat)
                    kernel, read, memcpy = row[:-2], row[-2], row[-1]
                    cells = [f"{r:>11.1f} GB/s" for r in kernel] + [f"{read:>4.1f} GB/s", f"{memcpy:>4.1f} GB/s"]
                    print(f"{str(dtype)[6:]:8} {q_heads:>7} {tokens:>7} {threads:>3} | " + " | ".join(cells)
                          + f" | {kernel[0] / read:8.2f} {kernel[0] / memcpy:11.2f}", flush=True)  # fmt: skip


def measure(dtype: torch.dtype, tokens: int, q_heads: int, threads: int, paths: list[int], repeat: int) -> list[float]:
    """GB/s of the kernel on each code path in ``paths``, then of torch.sum and of memcpy, over one layer."""
    raw, blocks, table = layer(tokens, dtype)
    flat, copy = raw.view(-1).view(dtype), torch.empty_like(raw)
    query = torch.randn(1, q_heads, 1, HEAD_DIM)
    nbytes = tokens * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    torch.set_num_threads(threads)

    def attend() -> None:
        host_kernel.paged_attention(query, blocks, table, tokens, scaling=HEAD_DIM**-0.5, threads=threads)

    rates = []
    try:
        for isa in paths:
            host_kernel.ISA = isa
            rates.append(cpu_rate(attend, nbytes, threads, repeat))
    finally:
        host_kernel.ISA = -1
    memcpy = cpu_rate(lambda: copy.copy_(raw), nbytes, threads, repeat)
    return [*rates, cpu_rate(flat.sum, nbytes, threads, repeat), memcpy]


if __name__ == "__main__":
    main()
