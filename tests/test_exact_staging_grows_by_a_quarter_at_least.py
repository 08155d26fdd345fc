"""Exact-gather staging grows by at least a quarter each time a layer outgrows it, so that decoding reallocates it
(and drops every prefetch in flight) a few times per doubling of the context, not at every new block."""

from __future__ import annotations

import torch
from helpers import kv, make_store

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.mover import ThreadMover


def test_decoding_from_40_to_80_tokens_grows_staging_three_times(tmp_path):
    """Block 4, a 40-token prompt: capacities 40, 52, 68, 88 tokens — not one growth per block (44, 48, ... 80)."""
    store = make_store(tmp_path, device_slots=8, host_slots=64, disk_bytes=None, staging_bytes=2**18)
    executor = ExactGather(store, ThreadMover(), num_layers=2, prefetch_depth=1)
    capacities = []
    for step in range(41):
        for layer in range(2):
            keys, values = kv(1, 40 if step == 0 else 1, seed=10 * step + layer)
            store.append(layer, keys, values)
            got_keys, got_values = executor.gather(Span.of(store, layer, 0))
            expected = store.read_tokens(layer)
            assert torch.equal(got_keys, expected[0]) and torch.equal(got_values, expected[1])
            del got_keys, got_values
            if not capacities or capacities[-1] != executor.capacity:
                capacities.append(executor.capacity)
    assert capacities == [40, 52, 68, 88]
    executor.close()
    store.close()
