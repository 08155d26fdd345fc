"""The host kernel's tiles where several query heads share a kv head (GQA), on every code path this CPU has.

The C kernel (``native/tierkv_attn.c``) serves a kv head's whole query group from each K/V row it loads: scores in
tiles of query rows by keys, the V rows in tiles of tokens, and prefetches each K/V stream ahead only as far as
the bytes the call reads. These tests pin each code path in turn (AVX-512, AVX2, portable C; a path the CPU lacks
runs as the widest it has) and compare with float64 softmax attention over the same keys: group sizes 1-8, token
counts and block sizes that leave every tile partial, several queries, causal windows and additive masks, pages
inside blocks, and runs of consecutive slots large enough to prefetch from one slot into the next.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_host_kernel import Pages, Placed, _close, _kv, reference

from tierkv.attention import host_kernel
from tierkv.layout import BlockLayout

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the C kernel cannot be built")  # fmt: skip

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = dict(
    group=st.sampled_from([1, 2, 3, 4, 8]),
    kv_heads=st.integers(1, 2),
    dim=st.sampled_from([128, 64, 80, 24, 20]),  # AVX-512 needs a multiple of 16, AVX2 of 8: 24 and 20 fall back
    q_len=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    isa=st.integers(0, len(host_kernel.ISAS) - 1),
    threads=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
"""Strategies shared by the random-shape tests."""
UNTIMED = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]  # monkeypatch pins the path per example


def _pin(isa: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernel's ``isa`` path, or the widest this CPU has below it."""
    if not host_kernel.available():
        pytest.fail(f"the C kernel does not load: {host_kernel._build()}")
    monkeypatch.setattr(host_kernel, "ISA", min(isa, int(host_kernel.library().tkv_attn_isa())))


@given(**GQA, block_tokens=st.sampled_from([7, 16, 37, 256]), tokens=st.integers(1, 600),
       masking=st.sampled_from(["causal", "window", "bias", "bias, not causal"]), batch=st.integers(1, 2),
       softcap=st.sampled_from([None, 30.0]))  # fmt: skip
@settings(max_examples=120, deadline=None, suppress_health_check=UNTIMED)
def test_query_groups_match_float64_softmax_on_every_code_path(monkeypatch, group, kv_heads, dim, q_len, dtype, isa,
                                                               threads, seed, block_tokens, tokens, masking, batch,
                                                               softcap):  # fmt: skip
    """Any GQA group, token count (tiles of scores and of V rows left partial), queries per row, causal window or
    additive mask (with keys before its start left out, and fully masked columns), soft-cap: the pinned code path
    equals float64 softmax attention."""
    _pin(isa, monkeypatch)
    q_len = min(q_len, tokens)
    keys, values = _kv(batch, kv_heads, tokens, dim, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, kv_heads * group, q_len, dim, generator=gen)
    placed = Placed(keys, values, block_tokens, seed=seed)
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(q_len, tokens + 1)) for _ in range(batch)]
    start = [length - q_len for length in lengths]
    causal = masking != "bias, not causal"
    window = int(rng.integers(1, tokens + 1)) if masking == "window" else None
    bias, mask_start = None, 0
    if masking.startswith("bias"):
        mask_start = int(rng.integers(0, min(lengths)))
        bias = torch.randn(batch, 1, q_len, max(lengths) - mask_start, generator=gen) * 3
        bias[:, :, :, rng.random(bias.shape[-1]) < 0.1] = float("-inf")
    got = host_kernel.paged_attention(q, placed.slab, placed.table, lengths, scaling=dim**-0.5, causal=causal,
                                      softcap=softcap, window=window, mask=bias, mask_start=mask_start,
                                      threads=threads)  # fmt: skip
    want = reference(q, keys, values, lengths, scaling=dim**-0.5, softcap=softcap,
                     query_start=start if causal else None, window=window,
                     bias=None if bias is None else bias[:, 0], mask_start=mask_start)  # fmt: skip
    _close(got, want)


@given(**GQA, geometry=st.sampled_from([(256, 16), (256, 64), (64, 8), (40, 5), (16, 16)]), entries=st.integers(1, 9))
@settings(max_examples=60, deadline=None, suppress_health_check=UNTIMED)
def test_query_groups_attend_pages_on_every_code_path(monkeypatch, group, kv_heads, dim, q_len, dtype, isa, threads,
                                                      seed, geometry, entries):  # fmt: skip
    """Sparse attention's pages inside blocks (each K/V stream stops prefetching at its page's rows), per GQA group
    and code path: the pages concatenated in table order are attended like contiguous keys."""
    _pin(isa, monkeypatch)
    block_tokens, entry_tokens = geometry
    pages = Pages(2, kv_heads, dim, block_tokens, entry_tokens, entries, dtype, seed=seed)
    tokens = entries * entry_tokens
    q_len = min(q_len, tokens)
    q = torch.randn(2, kv_heads * group, q_len, dim, generator=torch.Generator().manual_seed(seed + 1))
    lengths = [tokens, int(np.random.default_rng(seed).integers(q_len, tokens + 1))]
    start = [length - q_len for length in lengths]
    keys, values, _ = pages.gathered([tokens, tokens])
    got = host_kernel.paged_attention(q, pages.slab, pages.table, lengths, scaling=dim**-0.5, starts=pages.starts,
                                      entry_tokens=entry_tokens, threads=threads)  # fmt: skip
    _close(got, reference(q, keys, values, lengths, scaling=dim**-0.5, query_start=start))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("isa", range(len(host_kernel.ISAS)), ids=host_kernel.ISAS)
def test_runs_of_large_consecutive_slots(isa, dtype, monkeypatch):
    """Blocks of 512 KiB in consecutive slots (as a memory tier allocates a sequence's), the last one partly filled:
    the streams run from one slot into the next; one and two threads, a group of 4 and of 3."""
    _pin(isa, monkeypatch)
    kv_heads, dim, block_tokens, tokens = 2 * 4 // dtype.itemsize, 128, 256, 1000
    layout = BlockLayout(kv_heads, dim, block_tokens, dtype)
    n = math.ceil(tokens / block_tokens)
    keys, values = _kv(1, kv_heads, n * block_tokens, dim, dtype, seed=5)
    blocks = layout.blocks_of(torch.empty((n + 1, layout.slot_bytes), dtype=torch.uint8))
    for j in range(n):  # test setup, not the code under test
        blocks[1 + j, 0] = keys[0, :, j * block_tokens : (j + 1) * block_tokens]
        blocks[1 + j, 1] = values[0, :, j * block_tokens : (j + 1) * block_tokens]
    table = np.arange(1, n + 1)[None]
    for group, threads in ((4, 1), (4, 2), (3, 2)):
        q = torch.randn(1, kv_heads * group, 2, dim, generator=torch.Generator().manual_seed(group))
        got = host_kernel.paged_attention(q, blocks, table, tokens, scaling=dim**-0.5, threads=threads)
        want = reference(q, keys[:, :, :tokens], values[:, :, :tokens], [tokens], scaling=dim**-0.5,
                         query_start=[tokens - 2])  # fmt: skip
        _close(got, want)
