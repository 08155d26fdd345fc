"""The exact-gather executor over a real store: staged K/V equals the reference at every layer and step,
with prefetch depths 0-2, a synchronous mover (deterministic buffer reuse) and the threaded one."""

from __future__ import annotations

import pytest
import torch
from helpers import kv, make_store

from tierkv.attention.exact_gather import ExactGather
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
            got_k, got_v = executor.gather(layer, 0)
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
    got_k, got_v = executor.gather(0, 6)
    torch.testing.assert_close(got_k, keys[:, :, 6:], rtol=0, atol=0)
    torch.testing.assert_close(got_v, values[:, :, 6:], rtol=0, atol=0)
    executor.close()
    store.close()
