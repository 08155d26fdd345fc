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
