"""Exact gather reads each layer ahead at most once per step, however deep the prefetch.

With ``prefetch_depth`` 2 the layer two ahead is already on its way when the next layer asks for prefetches: reading
it again would move its K/V across the link twice, and leave the first read unaccounted (no barrier settles it).
Every read handed to the mover is used by the layer it was read for.
"""

from __future__ import annotations

import torch
from helpers import kv, make_store

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.mover import ThreadMover

LAYERS = 3


class CountingMover(ThreadMover):
    """The real thread mover, counting the reads handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs = 0

    def submit(self, job):
        self.jobs += 1
        return super().submit(job)


def test_every_prefetch_is_used_by_its_layer_at_depth_two(tmp_path):
    """Three layers mostly on the host, one 30-token prefill and two decode steps (staging never grows, so nothing
    is invalidated): the K/V is exact and each read handed to the mover is a prefetch hit or still pending."""
    store = make_store(tmp_path, device_slots=6, host_slots=64, disk_bytes=None, staging_bytes=2**16)
    mover = CountingMover()
    executor = ExactGather(store, mover, num_layers=LAYERS, prefetch_depth=2)
    stored: dict[int, torch.Tensor] = {}
    for step in range(3):
        for layer in range(LAYERS):
            keys, values = kv(1, 30 if step == 0 else 1, seed=10 * step + layer)
            new = torch.stack((keys, values))
            stored[layer] = new if step == 0 else torch.cat((stored[layer], new), dim=3)
            store.append(layer, keys, values)
            got_keys, got_values = executor.gather(Span.of(store, layer, 0))
            assert torch.equal(got_keys, stored[layer][0]) and torch.equal(got_values, stored[layer][1])
            del got_keys, got_values  # the model lets go of a layer's K/V before the next layer attends
    assert store.stats()["blocks"]["host"] > 0
    assert executor.prefetch_hits > 0
    assert mover.jobs == executor.prefetch_hits + executor.prefetch_misses + len(executor.pending)
    executor.close()
    store.close()
