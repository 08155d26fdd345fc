"""K/V that ``TieredCache.update`` handed out stays intact while the caller still holds it.

Models that share K/V across layers (Gemma 3n, Gemma 4) keep an earlier layer's K/V while later layers of the same
forward attend. The exact executor must then stage those later layers in other buffers, taking one more from the
device budget when every buffer is in use, and never write over a buffer whose K/V is still held.
"""

from __future__ import annotations

import pytest
import torch
from helpers import kv

from tierkv.hf import TieredCache

LAYERS, HEADS, DIM = 4, 2, 16


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_every_layers_kv_held_by_the_caller_survives_the_later_layers(depth):
    """The caller keeps every layer's K/V of a prompt and four decode steps: each stays equal to what the cache was
    given, although the later layers needed more staging buffers than the prefetch depth provides. The device
    budget counts exactly the staging buffers held, also after staging grew (and gave the extra buffers back)."""
    with TieredCache(gpu_gb="4MB", cpu_gb="1MB", block_tokens=4, prefetch_depth=depth) as cache:
        stored: dict[int, torch.Tensor] = {}
        for step in range(5):
            held = []
            for layer in range(LAYERS):
                keys, values = kv(1, 10 if step == 0 else 1, heads=HEADS, dim=DIM, seed=10 * step + layer)
                new = torch.stack((keys, values))
                stored[layer] = new if step == 0 else torch.cat((stored[layer], new), dim=3)
                held.append(cache.update(keys, values, layer))
            for layer, (got_keys, got_values) in enumerate(held):
                assert torch.equal(got_keys, stored[layer][0]), f"layer {layer}'s keys, step {step}"
                assert torch.equal(got_values, stored[layer][1]), f"layer {layer}'s values, step {step}"
            del held
            landing = 2 * cache.store.transfer.scratch.landing_bytes  # CUDA's two landing buffers (none on a CPU)
            assert cache.store.device.reserved == landing + sum(buffer.numel() for buffer in cache.executor.buffers)
