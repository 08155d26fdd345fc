"""The exact-gather executor over a real store: staged K/V equals the reference at every layer and step,
with prefetch depths 0-2, a synchronous mover (deterministic buffer reuse) and the threaded one."""

from __future__ import annotations

import pytest
import torch
from helpers import kv, make_store

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.blocks import Tier
from tierkv.mover import MoveHandle, ThreadMover


class SyncMover:
    """Runs each job at submission: makes buffer-reuse bugs deterministic instead of timing dependent."""

    name = "sync"

    def submit(self, job):
        from concurrent.futures import Future

        future: Future = Future()
        job()
        future.set_result(None)
        return MoveHandle(future)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("mover", [SyncMover, ThreadMover])
def test_gather_matches_reference_across_layers_and_steps(tmp_path, depth, mover):
    layers, batch = 3, 2
    store = make_store(tmp_path, device_slots=2 * layers * batch, host_slots=6, staging_bytes=2**15)
    executor = ExactGather(store, mover(), prefetch_depth=depth)
    reference: dict[int, torch.Tensor] = {}
    for step in range(14):
        for layer in range(layers):
            keys, values = kv(batch, 7 if step == 0 else 1, seed=100 * step + layer)
            new = torch.stack((keys, values))
            reference[layer] = new if layer not in reference else torch.cat((reference[layer], new), dim=3)
            store.append(layer, keys, values)
            got_k, got_v = executor.gather(Span.of(store, layer, 0))
            torch.testing.assert_close(got_k, reference[layer][0], rtol=0, atol=0)
            torch.testing.assert_close(got_v, reference[layer][1], rtol=0, atol=0)
    assert store.stats()["blocks"]["disk"] > 0
    if depth > 0:
        assert executor.prefetch_hits > 0
    executor.close()
    store.close()


def test_sliding_start_reads_a_suffix(tmp_path):
    store = make_store(tmp_path, device_slots=8, host_slots=8, staging_bytes=2**20)
    executor = ExactGather(store, SyncMover())
    keys, values = kv(1, 10)
    store.append(0, keys, values)
    got_k, got_v = executor.gather(Span.of(store, 0, 6))
    torch.testing.assert_close(got_k, keys[:, :, 6:], rtol=0, atol=0)
    torch.testing.assert_close(got_v, values[:, :, 6:], rtol=0, atol=0)
    executor.close()
    store.close()


def _disk_heavy_store(tmp_path, layers: int = 4):
    store = make_store(tmp_path, device_slots=4 * layers, host_slots=4, staging_bytes=2**17, disk_bytes=2**23,
                       extent_slots=64)
    reference = {}
    for layer in range(layers):
        keys, values = kv(1, 40, seed=layer)
        store.append(layer, keys, values)
        reference[layer] = torch.stack((keys, values))
    for layer in range(layers):  # most blocks to disk (two steps down)
        full = [store.table.blocks[int(b)] for b in store.table.rows[layer][0][:-1]]
        store.demote(full)
        store.demote([b for b in full if b.tier == Tier.HOST])
    return store, reference


def test_disk_reads_are_submitted_ahead_and_used(tmp_path):
    """Layers beyond the prefetch have their disk blocks in flight already; the reads that come use them."""
    store, reference = _disk_heavy_store(tmp_path)
    executor = ExactGather(store, ThreadMover(), num_layers=4, prefetch_depth=1)
    for _ in range(3):
        for layer in range(4):
            got_k, got_v = executor.gather(Span.of(store, layer, 0))
            torch.testing.assert_close(got_k, reference[layer][0], rtol=0, atol=0)
            torch.testing.assert_close(got_v, reference[layer][1], rtol=0, atol=0)
    assert executor.read_ahead_hits >= 8
    executor.close()
    store.close()


def test_a_read_ahead_of_a_changed_layer_is_not_used(tmp_path):
    store, reference = _disk_heavy_store(tmp_path)
    executor = ExactGather(store, SyncMover(), num_layers=4, prefetch_depth=1)
    executor.gather(Span.of(store, 0, 0))  # reads ahead layers 2 and 3
    assert {key[0] for key in executor._disk_ahead} >= {2}
    store.crop(2, 6)  # a table edit of layer 2 after its read was submitted
    executor.invalidate()
    for layer in (1, 2, 3):
        got_k, _ = executor.gather(Span.of(store, layer, 0))
        expected = reference[layer][0][:, :, : store.seq_length(layer)]
        torch.testing.assert_close(got_k, expected, rtol=0, atol=0)
    executor.close()
    store.close()


def test_small_layers_are_read_when_they_come(tmp_path):
    """Below ``prefetch_min`` bytes off the device a layer is not handed to the mover (it would cost more)."""
    from tierkv import settings

    store, _ = _disk_heavy_store(tmp_path)
    with settings.override(prefetch_min="1GB"):
        executor = ExactGather(store, ThreadMover(), num_layers=4, prefetch_depth=1)
    for layer in range(4):
        executor.gather(Span.of(store, layer, 0))
    assert executor.prefetch_hits == 0 and not executor.pending
    executor.close()
    store.close()


def test_telemetry_after_reset_counts_the_new_sequence(tmp_path):
    """Regression: the first step after a reset recorded negative new tokens (the old lengths were kept)."""
    from tierkv.bandwidth import LinkProfile
    from tierkv.stats import Timeline

    store = make_store(tmp_path, device_slots=32, host_slots=8, staging_bytes=2**16)
    executor = ExactGather(store, SyncMover(), num_layers=1, timeline=Timeline(LinkProfile({}), "test"))
    store.append(0, *kv(1, 20))
    executor.gather(Span.of(store, 0, 0))
    executor.reset()
    store.reset()
    store.append(0, *kv(1, 5))
    executor.gather(Span.of(store, 0, 0))
    store.append(0, *kv(1, 1))
    executor.gather(Span.of(store, 0, 0))
    assert [step.new_tokens for step in executor.timeline.completed()] == [20, 5]
    executor.close()
    store.close()


@pytest.mark.parametrize("depth", [0, 1])
def test_telemetry_puts_each_layers_compute_and_reads_in_its_own_step(tmp_path, depth):
    """A layer's records (the compute before it, a new step, its reads) reach the timeline in one call when nothing
    records in between (depth 0), one by one around a prefetch's stall and reads (depth 1): either way every layer
    of a step has its compute and reads the same bytes as the others (a new step begun after the prefetch of
    layer 0 was recorded would leave that layer's prefetched bytes in the step before)."""
    from tierkv.bandwidth import LinkProfile
    from tierkv.stats import Timeline

    layers = 3
    store = make_store(tmp_path, device_slots=64, host_slots=8, staging_bytes=2**16)
    executor = ExactGather(store, SyncMover(), num_layers=layers, prefetch_depth=depth,
                           timeline=Timeline(LinkProfile({}), "test"))
    executor.prefetch_min = 0
    for step in range(5):
        for layer in range(layers):
            store.append(layer, *kv(1, 9 if step == 0 else 1, seed=10 * step + layer))
            executor.gather(Span.of(store, layer, 0))
    steps = executor.timeline.completed()
    assert [step.new_tokens for step in steps] == [9, 1, 1, 1]  # staging holds 12 tokens until the last step
    assert (executor.prefetch_hits > 0) == (depth > 0)
    for step in steps[-2:]:
        assert step.layers is not None
        records = [step.layers[layer] for layer in range(layers)]
        assert all(record.compute_s > 0 for record in records)
        assert len({tuple(sorted(record.bytes.items())) for record in records}) == 1
        assert sum(record.bytes["device->device"] for record in records) == step.bytes["device->device"]
    executor.close()
    store.close()


def test_reads_ahead_are_bounded_in_bytes(tmp_path, monkeypatch):
    """Each read ahead holds a host buffer of its disk bytes: beyond the cap, fewer layers are read ahead."""
    from tierkv.attention import base

    store, _ = _disk_heavy_store(tmp_path, layers=6)
    one_layer = sum(part.blocks for part in store.plan_read(1, 0, 40).parts if part.tier == Tier.DISK)
    monkeypatch.setattr(base, "READ_AHEAD_BYTES", one_layer * store.layouts[1].slot_bytes)
    executor = ExactGather(store, SyncMover(), num_layers=6, prefetch_depth=1)
    executor.gather(Span.of(store, 0, 0))
    assert len(executor._disk_ahead) == 1  # the cap holds one layer's disk bytes
    executor.close()
    store.close()


MAX_MODULE_CHANGES = 106  # one exact-gather decode step of a 3-layer model (about 35 per layer)


def test_a_decode_step_crosses_few_module_seams():
    """``benchmarks/module_changes.py`` as a check: the decode step's hot path takes one coarse call per seam
    (layer -> store append, executor -> store read, store -> tier, executor -> timeline), so a traced step of a
    3-layer Llama changes tierkv module at most :data:`MAX_MODULE_CHANGES` times. On the CPU backend only: the
    CUDA stand-in's fake streams and events are calls of their own."""
    import importlib.util
    from pathlib import Path

    from tierkv import settings
    from tierkv.accel import backend

    if backend(torch.device("cpu")).streams:
        pytest.skip("the CUDA stand-in adds calls into tierkv.accel and tierkv.cuda_standin")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "module_changes.py"
    spec = importlib.util.spec_from_file_location("module_changes", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with settings.override(prefetch_min=4 << 20):  # the runtime's default (the suite prefetches every layer)
        changes, pairs = module.measure(layers=3, context=64)
    assert changes <= MAX_MODULE_CHANGES, pairs.most_common(12)
