"""An engaged model serves other threads too: ``cache.split(model)`` (and streaming, sparse) takes over the steps
of that cache only, in whatever thread runs them (a ``TextIteratorStreamer``'s generate thread); a forward of the
same model through another cache in another thread — a server's other request, with a ``DynamicCache`` or a tiered
cache in exact gather — runs the model's own implementation and its own mask, and two threads may engage the same
model at once, each with its cache. Checked against ``DynamicCache`` on sdpa and eager models (eager takes an
additive mask where sdpa takes a boolean one), with the other thread's forwards made while the engagement is held
(events and barriers, not timing)."""

from __future__ import annotations

import threading

import pytest
from helpers import assert_same_generation
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache

NEW = 6


def run(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache)


def in_threads(*jobs):
    """Run each job on its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(job):
        try:
            job()
        except BaseException as error:  # noqa: BLE001 (handed to the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    if errors:
        raise errors[0]


def waits_for_the_forward(action, resume: threading.Event) -> None:
    """Run ``action`` on a thread of its own while another thread's forward is held; it must wait for that forward
    (``resume`` lets the forward go on), then finish."""
    done = threading.Event()
    acting = threading.Thread(target=lambda: (action(), done.set()))
    acting.start()
    assert not done.wait(0.5)  # waits for the forward in progress
    resume.set()
    assert done.wait(120)
    acting.join(120)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_another_threads_forwards_run_the_models_own_attention(tmp_path, attn):
    model = tiny_model("llama", attn)
    ids, mask = prompt(2, 30, seed=5, left_pad=(0, 4))
    reference = run(model, ids, mask, DynamicCache())
    engaged, done = threading.Event(), threading.Event()
    outputs = {}

    def engaging():
        with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path / "a", block_tokens=4) as cache, \
                cache.split(model, chunk_tokens=8):  # fmt: skip
            engaged.set()
            assert done.wait(120)  # held while the other thread decodes
            outputs["split"] = run(model, ids, mask, cache)

    def other():
        assert engaged.wait(120)
        try:
            outputs["dynamic"] = run(model, ids, mask, DynamicCache())
            with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path / "b", block_tokens=4) as cache:
                outputs["gather"] = run(model, ids, mask, cache)
        finally:
            done.set()

    in_threads(engaging, other)
    for name in ("split", "dynamic", "gather"):
        assert_same_generation(outputs[name], reference, atol=1e-4)
    assert model.config._attn_implementation == attn


def test_two_threads_engage_one_model_each_with_its_cache(tmp_path):
    model = tiny_model("llama")
    prompts = [prompt(1, 30, seed=seed) for seed in (1, 2)]
    references = [run(model, ids, mask, DynamicCache()) for ids, mask in prompts]
    both_in, both_ran = threading.Barrier(2, timeout=120), threading.Barrier(2, timeout=120)
    outputs = {}

    def engaging(index: int, mode: str):
        def job():
            ids, mask = prompts[index]
            with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path / mode, block_tokens=4) as cache:
                engagement = cache.split(model, chunk_tokens=8) if mode == "split" else \
                    cache.sparse(model, tokens=1.0, chunk_tokens=8)  # fmt: skip
                with engagement:
                    both_in.wait()
                    outputs[index] = run(model, ids, mask, cache)
                    both_ran.wait()  # the other still engaged when this one leaves: the model stays switched
                if index == 0:
                    outputs["after"] = run(model, ids, mask, DynamicCache())
        return job

    in_threads(engaging(0, "split"), engaging(1, "sparse"))
    assert_same_generation(outputs[0], references[0], atol=1e-4)
    assert_same_generation(outputs[1], references[1], atol=1e-4)
    assert_same_generation(outputs["after"], references[0], atol=1e-4)
    assert model.config._attn_implementation == "sdpa"


def test_the_engaged_caches_steps_run_in_a_thread_the_block_started(tmp_path):
    """The streamer pattern: the block is entered here, generate runs on a thread started inside it."""
    model = tiny_model("llama", "eager")
    ids, mask = prompt(2, 30, seed=9, left_pad=(0, 3))
    reference = run(model, ids, mask, DynamicCache())
    outputs = {}
    gpu = TieredCache.min_split_device_bytes(model.config, 2, block_tokens=4, chunk_tokens=8) + 16384
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.split(model, chunk_tokens=8):  # fmt: skip
        in_threads(lambda: outputs.update(split=run(model, ids, mask, cache)))
        assert cache.stats()["blocks"]["disk"] > 0 and "split" in cache.executors
    assert_same_generation(outputs["split"], reference, atol=1e-4)


def test_a_forward_that_took_the_streaming_attention_as_the_last_engagement_left_attends_as_the_model(tmp_path):
    """Regression: a plain forward of another thread whose layers had looked the streaming attention function up
    just before the last engagement of the shared model left found its saved implementation gone, and failed with
    "runs only inside `with cache.streaming(model)`". It attends with the model's own implementation again."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tierkv.hf.attention import _attention

    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    with TieredCache(gpu_gb="4MB", cpu_gb="4MB", disk_dir=tmp_path) as cache, cache.streaming(model):
        pass
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 3, 16, generator=generator)
    key, value = torch.randn(2, 1, 2, 3, 16, generator=generator)
    got, _ = _attention(module, query, key, value, None, dropout=0.0, scaling=0.25, is_causal=True)
    want, _ = sdpa_attention_forward(module, query, key, value, None, dropout=0.0, scaling=0.25, is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_forward_of_another_thread_in_the_moment_the_model_is_switched_attends_as_the_model(tmp_path,
                                                                                              monkeypatch, attn):
    """Regression: entering the first engagement switched the shared model's implementation before recording what
    it had, so another thread's forward in between (a server's other request) failed ("runs only inside ...") or,
    on an eager model, built sdpa's boolean mask and decoded other tokens. That forward is made right after the
    switch here (the moment another thread could come in), and decodes as the model."""
    model = tiny_model("llama", attn)
    ids, mask = prompt(2, 30, seed=5, left_pad=(0, 4))
    reference = run(model, ids, mask, DynamicCache())
    switch, outputs = model.set_attn_implementation, {}

    def switched_then_another_forward(implementation):
        switch(implementation)
        if not outputs:
            outputs["between"] = run(model, ids, mask, DynamicCache())

    monkeypatch.setattr(model, "set_attn_implementation", switched_then_another_forward)
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.streaming(model, chunk_tokens=8):  # fmt: skip
        pass
    assert_same_generation(outputs["between"], reference, atol=1e-4)


def test_a_mask_built_as_the_last_engagement_left_is_the_models_own(monkeypatch):
    """A forward that looked the streaming mask builder up just before the last engagement left builds the mask of
    the implementation the model has again (eager's additive one), not sdpa's boolean one."""
    from transformers import masking_utils

    from tierkv.hf.attention import _mask

    model = tiny_model("llama", "eager")
    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS, "eager", lambda *a, **k: "eager's")
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: "sdpa's")
    assert _mask(config=model.config) == "eager's"


def test_leaving_the_block_while_its_generate_thread_is_mid_forward_waits_for_the_forward(tmp_path):
    """The streamer pattern with a client that leaves: the block ends while the generate thread it started is in
    the middle of a forward. Leaving switched the executors at once (staging given back, sparse summaries
    dropped) under that forward's layers, which failed with an IndexError or KeyError; it now waits for the forward
    to end, and the rest of the generation decodes with exact gather, equal to DynamicCache's."""
    import torch

    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=9)
    reference = run(model, ids, mask, DynamicCache())
    forwards, paused, resume = [0], threading.Event(), threading.Event()

    def pause_in_the_third_decode_step(module, args):
        forwards[0] += 1
        if forwards[0] == 4:  # the prefill, then decode steps
            paused.set()
            assert resume.wait(120)

    hook = model.model.layers[1].register_forward_pre_hook(pause_in_the_third_decode_step)
    outputs = {}
    try:
        with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache:
            block = cache.sparse(model, tokens=1.0, chunk_tokens=8)
            block.__enter__()
            generating = threading.Thread(target=lambda: outputs.update(got=run(model, ids, mask, cache)))
            generating.start()
            assert paused.wait(120)
            waits_for_the_forward(lambda: block.__exit__(None, None, None), resume)
            generating.join(120)
    finally:
        hook.remove()
        resume.set()
    assert_same_generation(outputs["got"], reference, atol=1e-4)
    assert torch.equal(outputs["got"].sequences, reference.sequences)


@pytest.mark.parametrize("held", [0, 1], ids=["before the first layer", "mid-forward"])
@pytest.mark.parametrize("mode", ["split", "streaming"])
def test_entering_the_block_while_another_threads_generate_is_in_a_forward_waits_for_it(tmp_path, held, mode):
    """A thread enters ``with cache.split/streaming(model)`` while the cache's generate thread is in a decode step
    (mid-forward, or past its mask and positions but before its first layer). Entering waits for that forward, and
    the switch of executors and of the model's attention happens between two forwards, so the next forward builds
    its mask for the attention it runs: it was refused ("built no attention mask") when the switch landed between its
    mask and its first layer. The generation equals DynamicCache's."""
    import torch
    from helpers import held_before

    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=10)
    reference = run(model, ids, mask, DynamicCache())
    outputs = {}
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache:
        block = getattr(cache, mode)(model, chunk_tokens=8)
        with held_before(model.model.layers[held], call=2) as (between, resume):  # the first decode step
            generating = threading.Thread(target=lambda: outputs.update(got=run(model, ids, mask, cache)))
            generating.start()
            assert between.wait(120)
            waits_for_the_forward(block.__enter__, resume)
            generating.join(120)
        block.__exit__(None, None, None)
    assert_same_generation(outputs["got"], reference, atol=1e-4)
    assert torch.equal(outputs["got"].sequences, reference.sequences)
