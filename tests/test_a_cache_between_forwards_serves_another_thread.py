"""A TieredCache serves one sequence of forwards at a time, but between forwards any thread may take it over.

A thread that is still alive keeps no claim on the cache once nothing of its forward is half done: after it
emptied the cache (``reset``), after its step was refused and taken back, or after an edit (``crop``) took back
a forward it had stopped part-way, another thread's forward is accepted and stores its tokens; only a forward
half done on a live thread refuses the others.
"""

from __future__ import annotations

import threading

import pytest
from helpers import STEP_CONFIG, forward_steps, kv_step

from tierkv import InvalidConfigError, TieredCache


def on_another_thread(work) -> list[BaseException]:
    """Run ``work`` on a new thread (this one stays alive meanwhile); what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # noqa: BLE001 (handed back to the test)
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(60)
    return errors


@pytest.fixture
def cache():
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, config=STEP_CONFIG) as cache:
        forward_steps(cache, 5, 1)
        forward_steps(cache, 1, 2)
        yield cache


def test_after_a_reset_another_thread_forwards(cache):
    """The main thread resets the cache it decoded with; a request thread's prompt is then stored whole."""
    cache.reset()
    assert on_another_thread(lambda: forward_steps(cache, 4, 3)) == []
    assert {layer.get_seq_length() for layer in cache.layers} == {4}


def test_after_a_step_refused_and_taken_back_another_thread_forwards(cache):
    """The main thread's next step is refused at its second layer (a step of another length) and taken back;
    the cache then serves a request thread's step, as it would this thread's."""
    cache.update(kv_step(1, 7), kv_step(1, 7), 0)
    with pytest.raises(InvalidConfigError):
        cache.update(kv_step(2, 8), kv_step(2, 8), 1)
    assert {layer.get_seq_length() for layer in cache.layers} == {6}
    assert on_another_thread(lambda: forward_steps(cache, 1, 4)) == []
    assert {layer.get_seq_length() for layer in cache.layers} == {7}


def test_after_a_crop_took_back_a_stopped_forward_another_thread_forwards(cache):
    """The main thread's step stopped after layer 0 (as a Ctrl-C in the model's code leaves it); its ``crop(-1)``,
    counted from layer 0's length as transformers counts it, takes that step back; a request thread's step is then
    accepted on layers of one length."""
    cache.update(kv_step(1, 7), kv_step(1, 7), 0)
    cache.crop(-1)
    assert {layer.get_seq_length() for layer in cache.layers} == {6}
    assert on_another_thread(lambda: forward_steps(cache, 1, 4)) == []
    assert {layer.get_seq_length() for layer in cache.layers} == {7}


def test_a_forward_half_done_on_a_live_thread_refuses_another(cache):
    """The other side: a step that reached only layer 0 on the main thread keeps the cache to this thread, so
    another thread's update is refused and nothing of it is stored."""
    cache.update(kv_step(1, 7), kv_step(1, 7), 0)
    errors = on_another_thread(lambda: forward_steps(cache, 1, 4))
    assert len(errors) == 1 and isinstance(errors[0], InvalidConfigError) and "another thread" in str(errors[0])
    assert [layer.get_seq_length() for layer in cache.layers] == [7, 6, 6]
