"""Step telemetry counts every byte the reads moved, also those of prefetches that a table edit made stale: the
copies ran (the barrier waits for them), so the link carried their bytes, and the bandwidth model fed by these
records must see them. The step records' host->device bytes add up to the store's own count of moved bytes."""

from __future__ import annotations

import torch
from helpers import kv, make_store

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.bandwidth import LinkProfile
from tierkv.mover import ThreadMover
from tierkv.stats import Timeline

LAYERS = 3


def _recorded(timeline: Timeline, link: str) -> int:
    steps = timeline.completed() + ([timeline.current] if timeline.current is not None else [])
    return sum(step.bytes.get(link, 0) for step in steps)


def test_bytes_of_prefetches_dropped_by_a_crop_are_in_the_step_records(tmp_path):
    store = make_store(tmp_path, device_slots=6, host_slots=64, disk_bytes=None, staging_bytes=2**16)
    timeline = Timeline(LinkProfile({}), "test")
    executor = ExactGather(store, ThreadMover(), num_layers=LAYERS, prefetch_depth=2, timeline=timeline)
    stored: dict[int, torch.Tensor] = {}
    for step in range(4):
        for layer in range(LAYERS):
            keys, _ = new = kv(1, 30 if step == 0 else 1, seed=10 * step + layer)
            store.append(layer, *new)
            stored[layer] = keys if step == 0 else torch.cat((stored[layer], keys), dim=2)
            if step == 2 and layer == 1:
                assert executor.pending  # layers read ahead of this point are now stale
                for edited in range(LAYERS):
                    store.crop(edited, 1)
                    stored[edited] = stored[edited][:, :, :-1]
                executor.invalidate()
            got_keys, _ = executor.gather(Span.of(store, layer, 0))
            assert torch.equal(got_keys, stored[layer])
            del got_keys
    executor.close()
    moved = store.bytes_moved["host->device"]
    assert moved > 0 and _recorded(timeline, "host->device") == moved
    store.close()
