"""Blocks demoted together take their lower-tier slots in sequence order (layer, then index), so a layer's blocks
lie there in the order they are read; whatever order they were named in."""

from __future__ import annotations

import torch
from helpers import kv, make_store

from tierkv.blocks import Tier


def test_blocks_named_out_of_order_take_slots_in_sequence_order(tmp_path):
    store = make_store(tmp_path, device_slots=16, host_slots=16)
    appended = {}
    for layer in (0, 1):
        keys, values = kv(1, 16, seed=layer)  # four full blocks a layer
        store.append(layer, keys, values)
        appended[layer] = torch.stack((keys, values))
    full = [b for b in store.table.blocks.values() if b.tokens == 4]
    named = sorted(full, key=lambda b: (-b.layer, -b.index))  # last layer's last block first
    store.demote(named)
    assert all(b.tier == Tier.HOST for b in full)
    for layer in (0, 1):
        slots = [b.slot for b in sorted((b for b in full if b.layer == layer), key=lambda b: b.index)]
        assert slots == sorted(slots), (layer, slots)  # ascending with the index: reads coalesce forwards
    for layer, expected in appended.items():
        torch.testing.assert_close(store.read_tokens(layer), expected, rtol=0, atol=0)
    store.check()
    store.close()
