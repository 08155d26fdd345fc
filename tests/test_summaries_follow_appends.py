"""Once key summaries are kept, every block an append fills is summarised as it fills — also the last new block
of an append whose tokens end exactly on a block boundary — and its summary is its keys' own per-channel min and
max (a block left without one would be scored as unknown and read at every step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierkv.attention.sparse_store import SparseBlocks
from tierkv.blocks import Tier
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.memory import MemoryTier

BT, HEADS, DIM = 4, 2, 8


@pytest.mark.parametrize("pieces", [[3, 1 + 2 * BT], [BT, 2 * BT], [3, 2 * BT + 1, BT - 1 + BT]])
def test_every_full_block_has_the_summary_of_its_keys(pieces):
    device = MemoryTier(Tier.DEVICE, 2**20, torch.device("cpu"), chunk_bytes=2**14)
    host = MemoryTier(Tier.HOST, 2**20, torch.device("cpu"), chunk_bytes=2**14)
    store = KVStore(device, host, None, make_policy("lru"), BT)
    tokens = sum(pieces)
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(2, HEADS, tokens, DIM, generator=generator).to(torch.bfloat16)  # summaries in their own dtype
    values = torch.randn(2, HEADS, tokens, DIM, generator=generator).to(torch.bfloat16)
    store.append(0, keys[:, :, : pieces[0]], values[:, :, : pieces[0]])
    summaries = SparseBlocks(store).enable_summaries(layer=0)
    done = pieces[0]
    for piece in pieces[1:]:
        store.append(0, keys[:, :, done : done + piece], values[:, :, done : done + piece])
        done += piece
    rows = store.table.rows[0]
    full = tokens // BT
    ids = rows.ids[:, :full]  # [B, full]
    found = summaries.rows(ids.ravel()).reshape(ids.shape)
    assert (found >= 0).all(), f"blocks without a summary: {np.argwhere(found < 0).tolist()}"
    table = summaries.table(0)  # [H_kv, rows, pages, 4, D]
    for row in range(2):
        for column in range(full):
            block = keys[row, :, column * BT : (column + 1) * BT].float()  # [H_kv, BT, D]
            summary = table[:, int(found[row, column]), 0].float()  # [H_kv, 4, D]
            torch.testing.assert_close(summary[:, 0], block.amin(1))
            torch.testing.assert_close(summary[:, 1], block.amax(1))
