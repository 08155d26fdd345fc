"""The page scoring kernel (``native/tierkv_scores.c``, :mod:`tierkv.attention.score_kernel`) against torch's
computation over the same summaries gathered (:func:`~tierkv.attention.score_kernel.page_scores_torch`, the path
accelerators take): random shapes, query groups, batches and table dtypes (hypothesis); and sparse attention
selecting the same pages with either."""

from __future__ import annotations

import pytest
import torch
from helpers import check_extension_loads_first
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sparse_pages import DIM, GROUPS, HEADS, PAGE, PER, attend, needle_query, store_with_needles

from tierkv import settings as tierkv_settings
from tierkv.attention import score_kernel
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.errors import InvalidConfigError
from tierkv.mover import ThreadMover

pytestmark = pytest.mark.skipif(not score_kernel.available(), reason="no C compiler: the kernel cannot be built")


def _table(heads: int, rows: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A summary table ``[H_kv, rows, 4, D]`` in ``dtype``: min <= mean <= max per channel, then a value mean."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, rows, 8, dim, generator=generator) * 2.0  # 8 keys per page
    values = torch.randn(heads, rows, dim, generator=generator)
    return torch.stack((keys.amin(2), keys.amax(2), keys.mean(2), values), dim=2).to(dtype)


def _reference(query: torch.Tensor, table: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch's scores of rows ``pages`` ``[B, n]``, gathered from ``table`` and widened as sparse attention does."""
    batch, entries = pages.shape
    heads, dim = table.shape[0], table.shape[-1]
    gathered = table[:, :, :3].index_select(1, pages.flatten())  # [H_kv, B·n, 3, D]
    stacked = gathered.view(heads, batch, entries, 3 * dim).transpose(0, 1).float()
    return score_kernel.page_scores_torch(query, stacked)


@settings(max_examples=60, deadline=None)
@given(heads=st.integers(1, 3), groups=st.sampled_from([1, 2, 3, 4, 7]),
       dim=st.sampled_from([8, 16, 48, 64, 80, 128, 256]), batch=st.integers(1, 3), entries=st.integers(0, 150),
       threads=st.sampled_from([1, 3]), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_the_kernel_equals_torch_over_the_gathered_rows(heads, groups, dim, batch, entries, threads, dtype, seed):
    """Every specialisation (head dimensions 64, 128, 256 and the others), each table dtype read where it is, rows
    in any order and repeated, pages cut into pieces across threads."""
    rows = 40
    table = _table(heads, rows, dim, dtype, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    pages = torch.randint(0, rows, (batch, entries), generator=generator)
    query = torch.randn(batch, heads, groups, dim, generator=generator) * dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scored = score_kernel.page_scores(query, table, pages)
    finally:
        torch.set_num_threads(previous)
    assert scored is not None
    for got, expected in zip(scored, _reference(query, table, pages), strict=True):
        assert got.shape == (batch, heads, groups, entries) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_row_outside_the_table_is_refused_by_name():
    table = _table(1, 4, 16, torch.bfloat16, 0)
    for row in (4, -1):
        with pytest.raises(InvalidConfigError, match="outside the summary table"):
            score_kernel.page_scores(torch.zeros(1, 1, 1, 16), table, torch.tensor([[0, row]]))


def test_wrong_shapes_are_refused_by_name():
    table = _table(1, 4, 16, torch.bfloat16, 0)
    with pytest.raises(InvalidConfigError, match="query must be contiguous"):
        score_kernel.page_scores(torch.zeros(1, 1, 1, 16, dtype=torch.float64), table, torch.tensor([[0, 1]]))
    with pytest.raises(InvalidConfigError, match="pages must be contiguous"):
        score_kernel.page_scores(torch.zeros(1, 1, 1, 16), table, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(InvalidConfigError, match="query is on meta; the C kernel reads CPU memory only"):
        score_kernel.page_scores(torch.zeros(1, 1, 1, 16, device="meta"), table, torch.tensor([[0, 1]]))


@pytest.mark.parametrize("tail_tokens", [3, 5 * PAGE + 3])
def test_sparse_attention_scores_and_selects_the_same_with_the_kernel_and_with_torch(tmp_path, monkeypatch,
                                                                                       tail_tokens):
    """A step scored by the kernel and one scored by torch (as on an accelerator) give the same bounds, pages,
    output and summary bytes counted, with and without the open tail's full pages competing."""
    store, _ = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False, tail_tokens=tail_tokens)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(3))
    budget = SparseBudget(0.2, page_tokens=PAGE)
    steps, calls = [], []
    kernel = score_kernel.page_scores

    def counting(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        scored = kernel(*args)
        calls.append(scored is not None)
        return scored

    monkeypatch.setattr(score_kernel, "page_scores", counting)
    for native in (True, False):
        monkeypatch.setattr(score_kernel, "runs_on", lambda device, native=native: native)
        executor = SparseAttention(store, ThreadMover())
        out = attend(executor, q, budget)
        assert executor._bound is not None
        steps.append((out, executor._bound[1], executor.last_pages.tolist(), executor.counters.summary_bytes_read))
        executor.close()
    assert calls == [True]  # the kernel scored the first step; torch the second
    (out, bound, pages, read), (torch_out, torch_bound, torch_pages, torch_read) = steps
    torch.testing.assert_close(bound, torch_bound, atol=1e-5, rtol=1e-5)
    assert pages == torch_pages and read == torch_read > 0
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


def test_setup_builds_the_extension_and_the_loader_takes_it(built_extensions, tmp_path, monkeypatch, caplog):
    check_extension_loads_first(score_kernel, "_scores", built_extensions, tmp_path, monkeypatch, caplog)


def test_without_a_compiler_the_kernel_is_unavailable_and_torch_scores(tmp_path, monkeypatch):
    """No extension and no compiler: unavailable with the reason, page_scores returns None (the caller gathers and
    scores with torch), and sparse attention still selects its pages."""
    monkeypatch.setattr(score_kernel, "extension", lambda: None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    score_kernel._build.cache_clear()
    try:
        with tierkv_settings.override(cache_dir=tmp_path / "cache"):
            assert not score_kernel.available()
            assert "C compiler" in str(score_kernel._build())
            table = _table(1, 4, 16, torch.bfloat16, 0)
            assert score_kernel.page_scores(torch.zeros(1, 1, 1, 16), table, torch.tensor([[0, 1]])) is None
            store, _ = store_with_needles(tmp_path, {0: (5, 2), 1: (9, 1)}, on_disk=False)
            executor = SparseAttention(store, ThreadMover())
            attend(executor, needle_query(), SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE))
            assert executor.last_pages.tolist() == [[0, 5 * PER + 2], [0, 9 * PER + 1]]
            executor.close()
    finally:
        score_kernel._build.cache_clear()
