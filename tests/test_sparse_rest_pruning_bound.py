"""The rest copy leaves out only pages whose summed attention mass Quest's bound proves below ``REST_PRUNE_MASS``
of the read pages' mass, counting every token of a page (a page's bound is per token: its mass is at most
``page_tokens`` times that). Checked where it matters: pages whose mass sits near the threshold, values chosen so
that the output's error is the omitted mass itself, against the same step with nothing left out."""

from __future__ import annotations

import pytest
import torch

from tierkv.attention import sparse_rest
from tierkv.attention.base import Span
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.mover import ThreadMover
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.memory import MemoryTier

HEADS, GROUPS, DIM, BT, PAGE = 2, 2, 8, 16, 4


def rest_step(strength: float) -> tuple[torch.Tensor, int]:
    """One step reading three pages (sink, needle, newest) of a 10-block store, the rest from an 8-bit copy. Every
    key has channel 0 at 1 (4 in the read pages); the values' channel 1 is 1 on the pages not read, 0 on the read
    ones, so that channel of the output is the share of attention the rest copy's pages got."""
    tokens = 10 * BT + 2
    device = MemoryTier(Tier.DEVICE, 2**21, torch.device("cpu"), chunk_bytes=2**14)
    host = MemoryTier(Tier.HOST, 2**21, torch.device("cpu"), chunk_bytes=2**14)
    store = KVStore(device, host, None, make_policy("lru"), BT)
    keys = torch.zeros(2, HEADS, tokens, DIM)
    keys[..., 0] = 1.0
    values = torch.zeros(2, HEADS, tokens, DIM)
    values[..., 1] = 1.0
    for first, stop in ((0, PAGE), (6 * BT + 4, 6 * BT + 8), (tokens - 2, tokens)):
        keys[..., first:stop, 0] = 4.0
    values[..., :PAGE, 1] = 0.0
    values[..., 6 * BT + 4 : 6 * BT + 8, 1] = 0.0
    values[..., 8 * BT :, 1] = 0.0
    store.append(0, keys, values)
    SparseBlocks(store).enable_summaries(page_tokens=PAGE)
    executor = SparseAttention(store, ThreadMover())
    executor.budget = SparseBudget(3 * PAGE, recent=0, page_tokens=PAGE, rest_bits=8)
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[..., 0] = strength
    out, _ = executor.attend(Span.of(store, 0), q, None, DIM**-0.5, None)
    assert executor.last_pages.tolist() == [[0, 6 * 4 + 1]] * 2
    executor.close()
    return out, executor.counters.rest_pages_pruned


@pytest.mark.parametrize("strength", [6.0, 7.0])
def test_pages_left_out_of_the_rest_copy_hold_at_most_the_pruned_mass(monkeypatch, strength):
    limit = 2 * sparse_rest.REST_PRUNE_MASS  # the omitted share of the mass, times the largest value (1)
    pruned, count = rest_step(strength)
    assert count > 0  # some pages were provably negligible
    monkeypatch.setattr(sparse_rest, "REST_PRUNE_MASS", 0.0)
    every, none = rest_step(strength)
    assert none == 0
    assert (pruned - every).abs().max() <= limit
