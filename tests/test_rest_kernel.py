"""The rest-copy attention kernel (``native/tierkv_rest.c``, :mod:`tierkv.attention.rest_kernel`) against a float64
softmax over the same rest copy decoded by torch (:meth:`KeySummaries.rest`): random shapes, bit widths, query
groups, masks, padding entries and soft-capping (hypothesis)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import check_extension_loads_first
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import settings as tierkv_settings
from tierkv.attention import rest_kernel
from tierkv.errors import InvalidConfigError
from tierkv.store.summaries import KeySummaries

pytestmark = pytest.mark.skipif(not rest_kernel.available(), reason="no C compiler: the kernel cannot be built")


def _summaries(bits: int, blocks: int, heads: int, block_tokens: int, page: int, dim: int,
               seed: int, dtype: torch.dtype = torch.float32) -> KeySummaries:
    summaries = KeySummaries(torch.device("cpu"), lambda n: None, lambda n: None, rest_bits=bits, page_tokens=page)
    generator = torch.Generator().manual_seed(seed)
    kv = torch.randn(blocks, 2, heads, block_tokens, dim, generator=generator)
    kv[:, 0] *= 2.0  # keys with some spread: softmax weights far from uniform
    summaries.add(0, list(range(blocks)), kv.to(dtype))
    return summaries


def _reference(q: torch.Tensor, summaries: KeySummaries, pages: torch.Tensor, counts: torch.Tensor,
               bias: torch.Tensor | None, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax over each row's first ``counts[b]`` pages, decoded by torch."""
    batch, heads, groups, dim = q.shape
    outs, lses = torch.zeros(batch, heads, groups, dim, dtype=torch.float64), torch.full((batch, heads, groups),
                                                                                         -math.inf, dtype=torch.float64)
    for b in range(batch):
        n = int(counts[b])
        if n == 0:
            continue
        keys, values = summaries.rest(0, pages[b, :n], torch.float32)  # [H_kv, n, pt, D]
        keys, values = keys.flatten(1, 2).double(), values.flatten(1, 2).double()
        logits = torch.einsum("hgd,htd->hgt", q[b].double(), keys)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if bias is not None:
            logits = logits + bias[b, : logits.shape[-1]].double()
        lses[b] = torch.logsumexp(logits, dim=-1)
        outs[b] = torch.einsum("hgt,htd->hgd", torch.softmax(logits, dim=-1), values)
    return outs, lses


@settings(max_examples=80, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 4, 8]),
       dim=st.sampled_from([8, 16, 32, 64, 80, 96, 128, 256]), page=st.sampled_from([1, 4, 8, 16]),
       batch=st.integers(1, 3), masked=st.booleans(), softcap=st.sampled_from([None, 5.0]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_the_kernel_equals_a_float64_softmax_over_the_decoded_copy(bits, heads, groups, dim, page, batch, masked,
                                                                    softcap, dtype, seed):
    """Every specialisation (head dimensions 64, 128, 256 and the others, each bit width), the summaries and value
    scales read in the KV's dtype where they are."""
    block_tokens = 2 * page
    summaries = _summaries(bits, 5, heads, block_tokens, page, dim, seed, dtype)
    rows = 5 * block_tokens // page
    generator = torch.Generator().manual_seed(seed + 1)
    entries = int(torch.randint(1, rows + 1, (1,), generator=generator))
    pages = torch.stack([torch.randperm(rows, generator=generator)[:entries] for _ in range(batch)])
    counts = torch.randint(0, entries + 1, (batch,), generator=generator)
    counts[0] = entries  # one row with every entry; the others may end early (padding entries never read)
    q = torch.randn(batch, heads, groups, dim, generator=generator) * dim**-0.5
    bias = None
    if masked:
        bias = torch.randn(batch, entries * page, generator=generator)  # an additive float mask, and masked keys
        bias[torch.rand(batch, entries * page, generator=generator) < 0.3] = torch.finfo(torch.float32).min
    out, lse = rest_kernel.rest_attention(q.contiguous(), *summaries.rest_packed(0), pages, counts, bias, bits, softcap)
    expected_out, expected_lse = _reference(q, summaries, pages, counts, bias, softcap)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 4, 5])
def test_one_row_and_head_cut_into_pieces_across_threads_equals_the_reference(threads):
    """Fewer rows x KV heads than threads: the entries are cut into pieces (at least 16 each), attended on the
    threads and merged by log-sum-exp — the same result as one piece, with rows whose entries end early (a piece
    with none) and masked keys."""
    summaries = _summaries(4, 40, 1, 32, 16, 64, 7)
    generator = torch.Generator().manual_seed(8)
    pages = torch.stack([torch.randperm(80, generator=generator)[:70] for _ in range(2)])
    counts = torch.tensor([70, 20])
    q = torch.randn(2, 1, 4, 64, generator=generator) * 0.125
    bias = torch.randn(2, 70 * 16, generator=generator)
    bias[:, ::7] = torch.finfo(torch.float32).min
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = rest_kernel.rest_attention(q, *summaries.rest_packed(0), pages, counts, bias, 4, None)
    finally:
        torch.set_num_threads(previous)
    expected_out, expected_lse = _reference(q, summaries, pages, counts, bias, None)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse.double(), expected_lse, atol=2e-5, rtol=1e-5)


def test_shapes_beyond_the_kernels_scratch_are_left_to_torch():
    summaries = _summaries(4, 2, 1, 16, 8, 16, 0)
    pages = torch.tensor([[0, 1]])
    q = torch.zeros(1, 1, rest_kernel.MAX_GROUP + 1, 16)
    assert rest_kernel.rest_attention(q, *summaries.rest_packed(0), pages, torch.tensor([2]), None, 4, None) is None


def test_a_page_outside_the_table_is_refused_by_name():
    summaries = _summaries(4, 2, 1, 16, 8, 16, 0)
    pages = torch.tensor([[0, 99]])
    with pytest.raises(InvalidConfigError, match="outside the rest copy"):
        rest_kernel.rest_attention(torch.zeros(1, 1, 1, 16), *summaries.rest_packed(0), pages, torch.tensor([2]),
                                   None, 4, None)


def test_wrong_shapes_are_refused_by_name():
    summaries = _summaries(4, 2, 1, 16, 8, 16, 0)
    pages = torch.tensor([[0, 1]])
    with pytest.raises(InvalidConfigError, match="query must be contiguous"):
        rest_kernel.rest_attention(torch.zeros(1, 1, 1, 16, dtype=torch.float64), *summaries.rest_packed(0), pages,
                                   torch.tensor([2]), None, 4, None)
    with pytest.raises(InvalidConfigError, match="query is on meta; the C kernel reads CPU memory only"):
        rest_kernel.rest_attention(torch.zeros(1, 1, 1, 16, device="meta"), *summaries.rest_packed(0), pages,
                                   torch.tensor([2]), None, 4, None)  # (a device address read as host memory)


def test_setup_builds_the_extension_and_the_loader_takes_it(built_extensions, tmp_path, monkeypatch, caplog):
    check_extension_loads_first(rest_kernel, "_rest", built_extensions, tmp_path, monkeypatch, caplog)


def test_without_a_compiler_the_kernel_is_unavailable_and_says_why(tmp_path, monkeypatch):
    """No extension and no compiler: unavailable with the reason, and rest_attention returns None (the caller
    decodes with torch), logging it once."""
    monkeypatch.setattr(rest_kernel, "extension", lambda: None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    rest_kernel._build.cache_clear()
    try:
        with tierkv_settings.override(cache_dir=tmp_path / "cache"):
            assert not rest_kernel.available()
            assert "C compiler" in str(rest_kernel._build())
            summaries = _summaries(4, 2, 1, 16, 8, 16, 0)
            pages = torch.tensor([[0, 1]])
            assert rest_kernel.rest_attention(torch.zeros(1, 1, 1, 16), *summaries.rest_packed(0), pages,
                                              torch.tensor([2]), None, 4, None) is None
    finally:
        rest_kernel._build.cache_clear()
