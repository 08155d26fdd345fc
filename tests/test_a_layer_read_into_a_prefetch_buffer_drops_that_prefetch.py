"""When every staging buffer is in use, a layer that was not prefetched takes the buffer of a prefetch still pending
for a later layer: that prefetch is dropped, and the later layer is then read afresh — never taken from the buffer
the earlier layer's K/V now occupies.

The case arises with a small layer left to be read when it comes (under ``prefetch_min``) between larger ones that
are prefetched, while the model keeps every layer's K/V for the rest of the forward (models that share K/V across
layers do).
"""

from __future__ import annotations

import threading

import torch
from helpers import kv, make_store

from tierkv import settings
from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.mover import ThreadMover
from tierkv.store import KVStore

TOKENS = {0: 40, 1: 40, 2: 4, 3: 40}  # layer 2's read weighs under prefetch_min: read when it comes


def _four_layers(tmp_path) -> tuple[KVStore, ExactGather, dict[int, torch.Tensor]]:
    """A store of the four layers of ``TOKENS``, an exact gather over it at prefetch depth 2 (layer 2 read when it
    comes), and each layer's K/V ``[2, ...]`` as stored."""
    store = make_store(tmp_path, device_slots=12, host_slots=64, disk_bytes=None, staging_bytes=2**17)
    stored: dict[int, torch.Tensor] = {}
    for layer, tokens in TOKENS.items():
        keys, values = kv(1, tokens, seed=layer)
        store.append(layer, keys, values)
        stored[layer] = torch.stack((keys, values))
    with settings.override(prefetch_min=10_000):
        executor = ExactGather(store, ThreadMover(), num_layers=len(TOKENS), prefetch_depth=2)
    return store, executor, stored


def test_a_pending_prefetch_whose_buffer_was_taken_is_read_again(tmp_path):
    """Four layers, prefetch depth 2, every layer's K/V kept until the pass ends: each layer gets its own K/V, and
    the K/V kept from earlier layers is still intact at the end of the pass."""
    store, executor, stored = _four_layers(tmp_path)
    for step in range(2):
        held = []
        for layer in TOKENS:
            held.append(executor.gather(Span.of(store, layer, 0)))
            assert torch.equal(held[-1][0], stored[layer][0]), f"layer {layer}'s keys, pass {step}"
        for layer, (keys, values) in zip(TOKENS, held):
            assert torch.equal(keys, stored[layer][0]) and torch.equal(values, stored[layer][1]), f"layer {layer}"
        del held, keys, values
    assert executor.prefetch_hits > 0
    executor.close()
    store.close()


def test_the_dropped_prefetch_has_finished_before_its_buffer_is_read_into(tmp_path):
    """The prefetch whose buffer is taken may still be queued on the mover (here behind a job that holds the mover
    for up to half a second): the layer that takes the buffer waits for it, so its own read is not overwritten by
    that prefetch's copies landing afterwards."""
    store, executor, stored = _four_layers(tmp_path)
    release = threading.Event()
    held = [executor.gather(Span.of(store, 0, 0))]  # prefetches layer 1 (layer 2 is read when it comes)
    executor.mover.submit(lambda: release.wait(0.5))  # the mover is busy: layer 3's prefetch waits behind this
    held.append(executor.gather(Span.of(store, 1, 0)))  # prefetches layer 3 into the last free buffer
    held.append(executor.gather(Span.of(store, 2, 0)))  # every buffer in use: takes layer 3's
    release.set()
    executor.mover.submit(lambda: None).wait()  # whatever was queued on the mover has run
    for layer, (keys, values) in enumerate(held):
        assert torch.equal(keys, stored[layer][0]) and torch.equal(values, stored[layer][1]), f"layer {layer}"
    keys, values = executor.gather(Span.of(store, 3, 0))
    assert torch.equal(keys, stored[3][0]) and torch.equal(values, stored[3][1])
    del held, keys, values
    executor.close()
    store.close()
