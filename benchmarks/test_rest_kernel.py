"""The rest-copy attention kernel (``native/tierkv_rest.c``) at the shapes of the models sparse attention runs, in
one run: codes decoded and attended per second, beside a plain read of the same bytes.

Every page of a 16K-token layer's rest copy (4 bits, 16-token pages, bf16 summaries as the store keeps them) is
attended by one decode query on one thread, as sparse attention attends the pages it did not read: the demo model
(2 KV heads x 32, 2 query heads each), SmolLM2-135M (3 x 64, 3 each) and Gemma 3 270M (1 x 256, 4). The kernel is
compute-bound (it decodes every code); a plain copy of the same codes (``copy_``, a memcpy) says what memory
alone would allow. Report only: no target (issue 30 measures the sparse step against its ceiling,
``benchmarks/test_sparse_ceiling.py``).

    pytest benchmarks/test_rest_kernel.py --benchmark-enable -s
"""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from rich.table import Table

from tierkv.attention import rest_kernel
from tierkv.calibrate import median_seconds
from tierkv.store.summaries import KeySummaries

SHAPES = {"demo": (2, 2, 32), "SmolLM2": (3, 3, 64), "Gemma 3": (1, 4, 256)}  # KV heads, query group, head dim
TOKENS, BLOCK_TOKENS, PAGE_TOKENS, BITS = 16384, 256, 16, 4

pytestmark = pytest.mark.skipif(not rest_kernel.available(), reason="no C compiler: the kernel cannot be built")


def _call(heads: int, groups: int, dim: int):
    """A layer's rest copy of random K/V and the kernel call over all of its pages: (call, codes, elements)."""
    summaries = KeySummaries(torch.device("cpu"), lambda n: None, lambda n: None, rest_bits=BITS,
                             page_tokens=PAGE_TOKENS)  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    blocks = TOKENS // BLOCK_TOKENS
    summaries.add(0, list(range(blocks)), torch.randn(blocks, 2, heads, BLOCK_TOKENS, dim, generator=generator))
    codes, table, scales = summaries.rest_packed(0)
    rows = codes.shape[1]
    query = torch.randn(1, heads, groups, dim, generator=generator) * dim**-0.5
    pages, counts = torch.arange(rows)[None], torch.tensor([rows])

    def call() -> None:
        rest_kernel.rest_attention(query, codes, table, scales, pages, counts, None, BITS, None)

    return call, codes, rows * PAGE_TOKENS * heads * dim * 2


@pytest.mark.parametrize("model", list(SHAPES))
def test_rest_kernel(benchmark, model: str) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call, _, _ = _call(*SHAPES[model])
        benchmark(call)
    finally:
        torch.set_num_threads(previous)


def test_rest_kernel_rates(capsys) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    table = Table(title=f"rest-copy attention, {TOKENS:,} tokens, {BITS}-bit codes, one thread")
    for column in ("model", "kernel", "codes per second", "memcpy of the codes", "kernel / memcpy"):
        table.add_column(column, justify="right")
    try:
        for model, shape in SHAPES.items():
            call, codes, elements = _call(*shape)
            kernel = median_seconds(call, warmup=2, repeats=15)
            copy = torch.empty_like(codes)
            read = median_seconds(lambda codes=codes, copy=copy: copy.copy_(codes), warmup=2, repeats=15)
            table.add_row(model, f"{kernel * 1e3:.2f} ms", f"{elements / kernel / 1e9:.2f} G",
                          f"{codes.nbytes / read / 1e9:.1f} GB/s", f"{kernel / read:.1f}x")  # fmt: skip
    finally:
        torch.set_num_threads(previous)
    with capsys.disabled():
        Console(width=120).print(table)
