"""The thread mover runs its jobs on one thread, one at a time, in submission order, and hands a job's error to
whoever waits for it; a job runs under the inference mode of the thread that submitted it.

The device budget counts one landing buffer for the mover's thread (transfer buffers are per thread), and a
prefetch queued behind another must not overtake it: a second worker would hold buffers no budget counts and run
reads out of order.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import kv, make_store

from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.mover import ThreadMover


def test_a_job_queued_behind_a_running_one_waits_for_it_on_the_same_thread():
    """The first job runs until the test lets it go; the jobs submitted meanwhile run after it, on its thread."""
    mover = ThreadMover()
    started, release = threading.Event(), threading.Event()
    ran: list[tuple[int, int]] = []

    def first() -> None:
        started.set()
        release.wait(30)
        ran.append((1, threading.get_ident()))

    handles = [mover.submit(first)]
    assert started.wait(30)
    handles += [mover.submit(lambda n=n: ran.append((n, threading.get_ident()))) for n in (2, 3)]
    release.set()
    for handle in handles:
        handle.wait()
    mover.close()
    assert [n for n, _ in ran] == [1, 2, 3]
    assert len({thread for _, thread in ran}) == 1


def test_a_failed_job_raises_at_wait_and_settle_does_not():
    """``wait`` re-raises the job's error (its data is unusable); ``settle``, for barriers, only waits."""
    mover = ThreadMover()

    def failing() -> None:
        raise OSError(5, "injected read failure")

    handle = mover.submit(failing)
    handle.settle()
    assert handle.done()
    with pytest.raises(OSError, match="injected read failure"):
        handle.wait()
    mover.close()


def test_prefetches_land_in_staging_made_under_inference_mode(tmp_path):
    """Staging made under ``torch.inference_mode()`` (as the layer-overhead calibration decodes) is written in place
    by the mover's jobs: they run under the caller's mode, so every prefetch lands instead of failing and falling
    back to a read when the layer comes."""
    store = make_store(tmp_path, device_slots=4, host_slots=32, disk_bytes=None, staging_bytes=2**16)
    executor = ExactGather(store, ThreadMover(), num_layers=2, prefetch_depth=1)
    with torch.inference_mode():
        for step in range(3):
            for layer in range(2):
                keys, values = kv(1, 12 if step == 0 else 1, seed=10 * step + layer)
                store.append(layer, keys, values)
                got_keys, _ = executor.gather(Span.of(store, layer, 0))
                assert torch.equal(got_keys, store.read_tokens(layer)[0])
    assert executor.prefetch_hits > 0 and executor.prefetch_misses == 0
    executor.close()
    store.close()
