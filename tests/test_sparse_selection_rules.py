"""The documented rules of a sparse decode step's selection, whatever its scores say: the first ``sinks`` tokens are
always attended (a count of tokens, so a part of a block or page brings in the whole unit that holds it), the
newest token's page is always attended, and the attended tokens never exceed the budget. Checked on a real store
with a query that points away from the sinks, so the scores alone would never choose them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.attention.base import Span
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.mover import ThreadMover
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.memory import MemoryTier

HEADS, GROUPS, DIM = 2, 2, 8


def empty_store(block_tokens: int) -> KVStore:
    """A KV store whose device and host tiers are CPU memory."""
    device = MemoryTier(Tier.DEVICE, 2**21, torch.device("cpu"), chunk_bytes=2**14)
    host = MemoryTier(Tier.HOST, 2**21, torch.device("cpu"), chunk_bytes=2**14)
    return KVStore(device, host, None, make_policy("lru"), block_tokens)


def away_from_the_query(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[2, HEADS, tokens, DIM]``: every key points away from the query direction ``e_0``."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(2, HEADS, tokens, DIM, generator=generator) * 0.1
    values = torch.randn(2, HEADS, tokens, DIM, generator=generator)
    keys[..., 0] = -1.0
    return keys, values


def make_store(block_tokens: int, tokens: int, needle: tuple[int, int], page: int | None,
               stronger: tuple[int, int] | None = None, strength: float = 5.0) -> tuple[KVStore, torch.Tensor]:
    """One KV store (device and host in CPU memory) holding ``tokens`` tokens of 2 rows; every key points away from
    the query direction ``e_0`` except those in ``[needle[0], needle[1])`` of KV head 0, which point along it (and
    those in ``stronger``, at ``strength``)."""
    store = empty_store(block_tokens)
    keys, values = away_from_the_query(tokens)
    keys[:, 0, needle[0] : needle[1], 0] = 4.0
    if stronger is not None:
        keys[:, 0, stronger[0] : stronger[1], 0] = strength
    for start in range(0, tokens, 5):
        store.append(0, keys[:, :, start : start + 5], values[:, :, start : start + 5])
    SparseBlocks(store).enable_summaries(page_tokens=page)
    return store, torch.stack((keys, values))


def query() -> torch.Tensor:
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[:, :, 0, 0] = 3.0
    return q


def attended_positions(executor: SparseAttention, block_tokens: int, page: int, tokens: int) -> list[set[int]]:
    """Every token position the last step attended, per row: its whole blocks, its pages and the open tail's chosen
    pages (the tail's unchosen full pages are masked)."""
    per = block_tokens // page
    out = []
    for row in range(executor.last_columns.shape[0]):
        held = {t for c in executor.last_columns[row] for t in range(c * block_tokens, min((c + 1) * block_tokens,
                                                                                            tokens))}
        if executor._tail_kept is not None:
            chosen, full = executor._tail_kept
            tail_first = (tokens - 1) // block_tokens * block_tokens
            hidden = {tail_first + p * page + t for p in range(full) if p not in chosen[row] for t in range(page)}
            held -= hidden
        if executor.last_pages is not None:
            held |= {p // per * block_tokens + p % per * page + t for p in executor.last_pages[row] if p >= 0
                     for t in range(page)}
        out.append(held)
    return out


def step(store: KVStore, budget: SparseBudget, start: int = 0) -> SparseAttention:
    executor = SparseAttention(store, ThreadMover())
    executor.budget = budget
    out, _ = executor.attend(Span.of(store, 0, start), query(), None, DIM**-0.5, None)
    assert torch.isfinite(out).all()
    return executor


def test_sinks_that_end_inside_a_block_bring_in_that_whole_block():
    """``sinks`` counts tokens: 5 sink tokens in 4-token blocks are blocks 0 and 1, both read although the query
    points at a block far from them, and the budget's other block goes to that one."""
    store, _ = make_store(4, 15 * 4 + 2, (9 * 4, 10 * 4), page=None)
    executor = step(store, SparseBudget(4 * 4, sinks=5, recent=0, page_tokens=4))
    assert executor.last_columns.tolist() == [[0, 1, 9, 15]] * 2
    executor.close()


def test_sink_tokens_that_end_inside_a_page_bring_in_that_whole_page():
    """With pages of 4 tokens in 16-token blocks, 5 sink tokens are pages 0 and 1: both attended whatever the scores
    (the query points at page 1 of block 6), beside the needle's page and the newest token's."""
    store, _ = make_store(16, 10 * 16 + 2, (6 * 16 + 4, 6 * 16 + 8), page=4)
    executor = step(store, SparseBudget(4 * 4, sinks=5, recent=0, page_tokens=4))
    assert executor.last_columns.tolist() == [[10]] * 2
    assert executor.last_pages.tolist() == [[0, 1, 6 * 4 + 1]] * 2
    executor.close()


@pytest.mark.parametrize("tail", [1, 3, 4, 5, 8, 11, 12, 15])
@pytest.mark.parametrize("budget", [8, 12, 20])
def test_the_newest_tokens_page_is_attended_and_the_budget_holds(tail, budget):
    """However full the open tail is (its full pages compete with the others), the step attends the newest token
    and the rest of its page, the sink page, and no more tokens than the budget; the needle in an older block
    is found when the budget leaves room for it."""
    bt, page = 16, 4
    tokens = 8 * bt + tail
    store, _ = make_store(bt, tokens, (3 * bt + 8, 3 * bt + 12), page=page)
    executor = step(store, SparseBudget(budget, sinks=page, recent=0, page_tokens=page))
    newest_page = set(range((tokens - 1) // page * page, tokens))
    for held in attended_positions(executor, bt, page, tokens):
        assert newest_page <= held
        assert set(range(page)) <= held
        assert len(held) <= budget
        if budget >= 3 * page:
            assert set(range(3 * bt + 8, 3 * bt + 12)) <= held
    executor.close()


def test_attended_tokens_match_a_plain_softmax_over_the_selection():
    """What the step returns is exact attention over the tokens it reports attending (a float64 softmax over them)."""
    bt, page, tail = 16, 4, 9
    tokens = 8 * bt + tail
    store, kv = make_store(bt, tokens, (3 * bt + 8, 3 * bt + 12), page=page)
    executor = SparseAttention(store, ThreadMover())
    executor.budget = SparseBudget(16, sinks=page, recent=0, page_tokens=page)
    q = torch.randn(2, HEADS * GROUPS, 1, DIM, generator=torch.Generator().manual_seed(7))
    out, _ = executor.attend(Span.of(store, 0), q, None, DIM**-0.5, None)
    for row, held in enumerate(attended_positions(executor, bt, page, tokens)):
        positions = sorted(held)
        k = kv[0, row][:, positions].double().repeat_interleave(GROUPS, 0)
        v = kv[1, row][:, positions].double().repeat_interleave(GROUPS, 0)
        weights = torch.softmax(q[row, :, 0].double()[:, None] @ k.transpose(1, 2) * DIM**-0.5, dim=-1)
        np.testing.assert_allclose(out[row, :, 0].double().numpy(), (weights @ v)[:, 0].numpy(), atol=1e-5)
    executor.close()


def test_a_window_selects_no_page_before_its_start():
    """A sliding window starting inside a block (token 56 of 16-token blocks, 4-token pages): the page before its
    start holds the keys the query likes best, yet it is outside the window, so the step gives its budget to the
    window's sink page, the best page inside the window and the newest token's page."""
    bt, page = 16, 4
    tokens = 10 * bt + 2
    start = 3 * bt + 8
    store, _ = make_store(bt, tokens, (6 * bt + 4, 6 * bt + 8), page=page, stronger=(3 * bt, 3 * bt + 4))
    executor = step(store, SparseBudget(3 * page, recent=0, page_tokens=page), start=start)
    assert executor.last_pages.tolist() == [[start // page, 6 * 4 + 1]] * 2
    executor.close()


def test_a_key_before_the_windows_start_takes_no_share_from_the_pages_inside_it():
    """A page before the window's start whose keys the query likes far more than any inside (8 against the needle's
    4): were it in the softmax of the estimated shares, it would take nearly all of KV head 0's share, the needle's
    would fall below the other head's flat shares, and the max over heads would pick a page by noise."""
    bt, page = 16, 4
    tokens = 10 * bt + 2
    start = 3 * bt + 8
    store, _ = make_store(bt, tokens, (6 * bt + 4, 6 * bt + 8), page=page, stronger=(3 * bt, 3 * bt + 4),
                          strength=8.0)
    executor = step(store, SparseBudget(3 * page, recent=0, page_tokens=page), start=start)
    assert executor.last_pages.tolist() == [[start // page, 6 * 4 + 1]] * 2
    executor.close()


def test_a_page_one_query_head_needs_beats_one_several_heads_like_a_little():
    """A page's score is the most any query head would give it: query head 0 points sharply at block 5 (on its KV
    head only), the three other heads moderately at block 10; with room for one scored block, block 5 is read,
    although the heads' average share would favour block 10."""
    bt = 4
    tokens = 15 * bt + 2
    store = empty_store(bt)
    keys, values = away_from_the_query(tokens)
    keys[:, 0, 5 * bt : 6 * bt, 0] = 4.0  # what query head 0 looks for, on KV head 0
    keys[:, :, 10 * bt : 11 * bt, 1] = 2.0  # what the other heads like, on every KV head
    store.append(0, keys, values)
    SparseBlocks(store).enable_summaries()
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[:, 0, 0, 0] = 3.0
    q[:, 1:, 0, 1] = 4.0
    executor = SparseAttention(store, ThreadMover())
    executor.budget = SparseBudget(3 * bt, recent=0)
    executor.attend(Span.of(store, 0), q, None, DIM**-0.5, None)
    assert executor.last_columns.tolist() == [[0, 5, 15]] * 2
    executor.close()


def test_a_page_that_got_less_than_the_sticky_share_is_not_kept_selected():
    """Only a page that took at least ``sticky_share`` of some head's attention is raised at the next step: a query
    of zeros spreads its attention evenly over the three pages it read (0.4 each at most, below 0.5), so at the
    next step a query leaning only slightly towards the needle's page (6 · 4 + 1) gets that page, not the one
    picked by the tie before."""
    bt, page = 16, 4
    store, _ = make_store(bt, 10 * bt + 2, (6 * bt + 4, 6 * bt + 8), page=page)
    executor = SparseAttention(store, ThreadMover())
    assert executor.sticky_share == 0.5
    executor.budget = SparseBudget(3 * page, recent=0, page_tokens=page)
    executor.attend(Span.of(store, 0), torch.zeros(2, HEADS * GROUPS, 1, DIM), None, DIM**-0.5, None)
    first = executor.last_pages[:, 1].tolist()
    assert first != [6 * 4 + 1] * 2  # the tie went elsewhere
    leaning = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    leaning[:, :, 0, 0] = 0.3
    executor.attend(Span.of(store, 0), leaning, None, DIM**-0.5, None)
    assert executor.last_pages.tolist() == [[0, 6 * 4 + 1]] * 2
    executor.close()
