"""The attention policy promotes the blocks a sparse step finds hot from any tier below the device: a needle block
held in host memory (no disk tier at all) reaches the device after a few steps of being read, and every token
stays where the table says."""

from __future__ import annotations

import torch

from tierkv.attention.base import Span
from tierkv.attention.sparse import SparseAttention, SparseBudget
from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.mover import ThreadMover
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.memory import MemoryTier

BT, HEADS, GROUPS, DIM, COLUMNS = 4, 2, 2, 8, 16


def test_attention_policy_moves_a_hot_host_block_to_the_device():
    device = MemoryTier(Tier.DEVICE, 96 * 4096, torch.device("cpu"), chunk_bytes=2 * 4096)
    host = MemoryTier(Tier.HOST, 96 * 4096, torch.device("cpu"), chunk_bytes=2 * 4096)
    store = KVStore(device, host, None, make_policy("attention"), BT)
    tokens = (COLUMNS - 1) * BT + 2
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, HEADS, tokens, DIM, generator=generator) * 0.1
    values = torch.randn(2, HEADS, tokens, DIM, generator=generator)
    keys[..., 0] = -1.0
    keys[:, 0, 5 * BT : 6 * BT, 0] = 4.0
    store.append(0, keys, values)
    SparseBlocks(store).enable_summaries()
    store.demote([b for b in store.table.blocks.values() if b.tokens == BT and b.tier == Tier.DEVICE])
    needle_id = int(store.table.rows[0].ids[0, 5])
    assert store.table.blocks[needle_id].tier == Tier.HOST
    executor = SparseAttention(store, ThreadMover())
    executor.budget = SparseBudget(3 * BT, sinks=BT, recent=0)
    q = torch.zeros(2, HEADS * GROUPS, 1, DIM)
    q[:, 0, 0, 0] = 3.0
    for _ in range(3):
        executor.attend(Span.of(store, 0), q, None, DIM**-0.5, None)
        assert executor.last_columns.tolist() == [[0, 5, COLUMNS - 1]] * 2
    assert store.table.blocks[needle_id].tier == Tier.DEVICE and executor.counters.promotions >= 1
    store.check()
    torch.testing.assert_close(store.read_tokens(0), torch.stack((keys, values)))
    executor.close()
