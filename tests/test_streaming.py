"""Exact streaming attention (``cache.streaming(model)``) against DynamicCache on real model classes.

The device budget here is far below ``min_device_bytes`` (which sizes exact gather's whole-layer staging):
streaming needs only two chunk buffers.
"""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch
from helpers import assert_same_generation, assert_same_generation_up_to_ties
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache, TierKVError
from tierkv.hf import attention, runtime
from tierkv.tiers.memory import MemoryTier

NEW = 8
CASES = [  # (id, family, attention implementation, sliding window)
    ("llama", "llama", "sdpa", None),
    ("llama-eager", "llama", "eager", None),
    ("mistral-sw8", "mistral", "sdpa", 8),
    ("qwen3", "qwen3", "sdpa", None),
    ("gemma2-sw8", "gemma2", "eager", 8),
    ("phi3", "phi3", "sdpa", None),
]


def run(model, ids, mask, cache, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache, **kwargs)


def small_cache(tmp_path, model, with_config: bool) -> TieredCache:
    return TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4,
                       config=model.config if with_config else None)


@pytest.mark.parametrize("with_config", [False, True], ids=["no-config", "config"])
@pytest.mark.parametrize(("name", "family", "attn", "window"), CASES, ids=[c[0] for c in CASES])
def test_streaming_generation_matches_dynamic_cache(tmp_path, name, family, attn, window, with_config):
    model = tiny_model(family, attn, window)
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 6))
    reference = run(model, ids, mask, DynamicCache(), prefill_chunk_size=16)
    with small_cache(tmp_path, model, with_config) as cache:
        with cache.streaming(model, chunk_tokens=8):
            assert model.config._attn_implementation == "tierkv_streaming"
            out = run(model, ids, mask, cache, prefill_chunk_size=16)
        assert model.config._attn_implementation == attn  # restored
        stats = cache.stats()
        if not (with_config and name == "mistral-sw8"):  # all layers sliding: the window fits above disk
            assert stats["blocks"]["disk"] > 0 and stats["bytes_moved"]["disk->device"] > 0
        assert stats["peak_bytes_allocated"]["device"] <= stats["budget_bytes"]["device"]
        assert stats["budget_bytes"]["device"] < TieredCache.min_device_bytes(model.config, 48, 2, block_tokens=4)
    assert_same_generation(out, reference, atol=1e-5)


def test_streaming_beam_search_matches(tmp_path):
    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=4)
    reference = run(model, ids, mask, DynamicCache(), num_beams=2)
    with small_cache(tmp_path, model, False) as cache, cache.streaming(model, chunk_tokens=12):
        out = run(model, ids, mask, cache, num_beams=2)
    assert torch.equal(out.sequences, reference.sequences)


def test_switching_between_gather_and_streaming_mid_sequence(tmp_path):
    """Both executors read the same store: prefill with exact gather, decode streaming."""
    model = tiny_model("qwen2")
    ids, mask = prompt(1, 20, seed=5)
    reference = DynamicCache()
    with TieredCache(gpu_gb="1MB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        expected = model(ids, past_key_values=reference).logits[:, -1]
        got = model(ids, past_key_values=cache).logits[:, -1]
        token = expected.argmax(-1, keepdim=True)
        for _ in range(5):
            expected = model(token, past_key_values=reference).logits[:, -1]
            with cache.streaming(model, chunk_tokens=8):
                got = model(token, past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            token = expected.argmax(-1, keepdim=True)


def test_another_cache_inside_the_context_runs_the_models_own_attention(tmp_path):
    """Only the engaged cache's steps are taken over: a forward through another cache (here a DynamicCache) gets
    the model's own attention and mask, and its exact logits."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = model(ids, past_key_values=DynamicCache()).logits
    with TieredCache(block_tokens=4) as cache, cache.streaming(model):
        torch.testing.assert_close(model(ids, past_key_values=DynamicCache()).logits, expected, atol=1e-6, rtol=0)


def test_one_engagement_entered_twice_leaves_the_model_as_it_was(tmp_path):
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    with TieredCache(block_tokens=4) as cache:
        engagement = cache.streaming(model)
        with engagement, engagement:
            model(ids, past_key_values=cache)
        assert model.config._attn_implementation == "sdpa" and id(model) not in attention._HELD
        assert not cache.runtime.modes


def test_a_hand_over_no_attention_took_is_dropped(tmp_path):
    """Direct ``cache.update`` calls inside the block hand steps over that no attention takes: the thread's next
    forward through another cache still gets the model's own attention."""
    model = tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    expected = model(ids, past_key_values=DynamicCache()).logits
    with TieredCache(block_tokens=4) as cache, cache.streaming(model):
        keys = torch.randn(1, 2, 3, 16)
        cache.update(keys, keys, 0)
        torch.testing.assert_close(model(ids, past_key_values=DynamicCache()).logits, expected, atol=1e-6, rtol=0)


def test_streaming_attention_outside_the_context_is_an_error(tmp_path):
    model = tiny_model("llama", "sdpa", None, layers=1)
    with TieredCache(block_tokens=4) as cache:
        with cache.streaming(model):
            pass
        model.set_attn_implementation("tierkv_streaming")
        try:
            with pytest.raises(TierKVError, match="inside `with cache.streaming"):
                model(torch.tensor([[5, 6, 7]]))
        finally:
            model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("streaming", [False, True], ids=["gather", "streaming"])
def test_bf16_models(tmp_path, streaming):
    """Blocks keep the model's dtype: exact gather is bit-exact in bf16; streaming accumulates in fp32, so it
    matches to bf16 rounding (and may break a tie of the reference's top two logits the other way)."""
    import contextlib
    import copy

    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    ids, mask = prompt(2, 40, seed=1, left_pad=(0, 3))
    reference = run(model, ids, mask, DynamicCache())
    with TieredCache(gpu_gb="200KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        with cache.streaming(model, chunk_tokens=8) if streaming else contextlib.nullcontext():
            out = run(model, ids, mask, cache)
        assert cache.stats()["blocks"]["host"] > 0
    if streaming:  # greedy may break a bf16 tie the other way (one ulp apart): compared up to it
        assert_same_generation_up_to_ties(out, reference, atol=2e-2)
    else:
        assert_same_generation(out, reference, atol=0.0)


def test_streaming_prefetches_across_layers_and_reports_each_step(tmp_path):
    """The next layer's first chunk is fetched during this layer's last, and every decode step has telemetry
    whose bytes are exactly the K/V the step attended over."""
    model = tiny_model("llama", layers=3)
    ids, mask = prompt(1, 40, seed=6)
    reference = run(model, ids, mask, DynamicCache())
    with small_cache(tmp_path, model, True) as cache:
        with cache.streaming(model, chunk_tokens=8):
            out = run(model, ids, mask, cache)
        stats = cache.stats()
        token_bytes = cache.store.layouts[0].token_bytes
    assert torch.equal(out.sequences, reference.sequences)
    # every layer of every decode step after the first starts from a chunk fetched during the layer before
    assert stats["prefetch_hits"] >= 3 * (NEW - 2) and stats["prefetch_misses"] == 0
    steps = stats["steps"]
    assert steps["kind"] == "decode" and steps["count"] == NEW - 1  # leaving the streaming block closed the last
    last = steps["last"]
    assert sum(last["bytes_by_link"].values()) == 3 * last["context"] * token_bytes
    assert last["bytes_by_link"]["disk->device"] > 0 and last["transfer_s_by_link"]["disk->device"] > 0
    assert last["predicted_step_s"] > 0 and last["compute_s"] > 0
    assert last["compute_s"] + last["stall_s"] <= last["wall_s"] * 1.001


def test_streaming_crop_drops_the_prefetched_chunk(tmp_path):
    """A crop between steps makes the chunk already fetched for the next step stale: results stay exact."""
    model = tiny_model("llama", layers=2)
    twin = copy.deepcopy(model)  # the reference runs beside the streaming model, with its own attention
    ids, _ = prompt(1, 6, seed=7)  # context < one chunk: the chunk fetched ahead covers the cropped tokens
    reference = DynamicCache()
    with TieredCache(gpu_gb="40KB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            cache.streaming(model, chunk_tokens=16):
        expected = twin(ids, past_key_values=reference).logits[:, -1]
        model(ids, past_key_values=cache)
        for step in range(6):
            token = expected.argmax(-1, keepdim=True)
            if step == 3:  # rewrite the last 5 tokens: the chunk fetched ahead for layer 0 holds the old ones
                reference.crop(-5)
                cache.crop(-5)
                token = torch.tensor([[11, 12, 13, 14, 15]])
            expected = twin(token, past_key_values=reference).logits[:, -1]
            got = model(token, past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        assert cache.stats()["prefetch_misses"] == 1 and cache.stats()["prefetch_hits"] >= 2 * 4


class LazyMover:
    """A mover that runs each job inside ``wait`` (or ``settle``) on the caller's thread: a prefetch then
    always lands while the model waits for it, with no thread timing involved."""

    name = "lazy"

    def submit(self, job):
        return LazyHandle(job)

    def close(self) -> None:
        pass


class LazyHandle:
    running = False  # a job is running inside wait/settle

    def __init__(self, job) -> None:
        self.job, self.ran = job, False

    def wait(self) -> None:
        if not self.ran:
            self.ran, LazyHandle.running = True, True
            try:
                self.job()
            finally:
                LazyHandle.running = False

    def settle(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()

    def done(self) -> bool:
        return self.ran


def _virtual_slow_reads(monkeypatch, in_prefetch: bool) -> None:
    """Prefetches (``in_prefetch``) or synchronous top-ups take 1 s of a virtual clock (no sleep, no race)."""
    real = time.perf_counter
    offset = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])
    original = MemoryTier.start_read

    def start_read(self, *args, **kwargs):  # inside the read's timing marks
        if LazyHandle.running == in_prefetch:
            offset[0] += 1.0
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MemoryTier, "start_read", start_read)
    monkeypatch.setattr(runtime, "make_mover", lambda device: LazyMover())


def test_waiting_for_a_prefetched_chunk_is_stall_not_compute(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=3)
    ids, mask = prompt(1, 40, seed=6)
    _virtual_slow_reads(monkeypatch, in_prefetch=True)
    with TieredCache(gpu_gb="200KB", block_tokens=4, config=model.config) as cache:
        with cache.streaming(model, chunk_tokens=64):  # one chunk per layer, each fetched ahead
            run(model, ids, mask, cache)
        last = cache.stats()["steps"]["last"]
    assert last["stall_s"] >= 3.0  # 3 prefetched chunks of 1 virtual second each, all waited for
    assert last["compute_s"] < 1.0


def test_a_top_up_read_is_not_counted_as_compute(tmp_path, monkeypatch):
    model = tiny_model("llama", layers=3)
    ids, mask = prompt(1, 40, seed=6)
    _virtual_slow_reads(monkeypatch, in_prefetch=False)
    with TieredCache(gpu_gb="200KB", block_tokens=4, config=model.config) as cache:
        with cache.streaming(model, chunk_tokens=64):  # the context is inside the first chunk: every layer tops up
            run(model, ids, mask, cache)
        last = cache.stats()["steps"]["last"]
    assert last["sync_read_s"] >= 3.0  # 3 top-ups of 1 virtual second
    assert last["compute_s"] < 1.0


def test_switching_executors_ends_the_step_in_progress(tmp_path):
    """Gather and streaming share the telemetry: a hand-off (and the idle time around it) is no one's compute."""
    model = tiny_model("qwen2")
    ids, _ = prompt(1, 20, seed=5)
    with TieredCache(gpu_gb="1MB", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        token = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        for phase in range(4):
            time.sleep(0.05)
            context = contextlib.nullcontext() if phase % 2 else cache.streaming(model, chunk_tokens=8)
            with context:
                for _ in range(3):
                    token = model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
        steps = cache.executor.timeline.completed()
    assert [step.new_tokens for step in steps] == [20] + [1] * 11  # the last gather step is still open
    for step in steps:
        assert step.compute_s + step.stall_s <= step.wall_s + 1e-6
    assert steps[-1].layers is not None and set(steps[-1].layers) == {0, 1}  # a gather step: its 2 layers only


def test_without_a_config_the_first_pass_prefetches_nothing_it_throws_away(tmp_path):
    model = tiny_model("llama", layers=5)
    ids, mask = prompt(1, 40, seed=6)
    with small_cache(tmp_path, model, False) as cache:
        with cache.streaming(model, chunk_tokens=8):
            run(model, ids, mask, cache)
        stats = cache.stats()
    assert stats["prefetch_misses"] == 0 and stats["prefetch_hits"] > 0


def test_a_sliding_window_drop_discards_the_prefetched_chunk(tmp_path):
    model = tiny_model("mistral", "sdpa", 8)
    ids, mask = prompt(1, 40, seed=6)
    reference = run(model, ids, mask, DynamicCache())
    with small_cache(tmp_path, model, True) as cache:
        with cache.streaming(model, chunk_tokens=8):
            out = run(model, ids, mask, cache)
        assert cache.stats()["prefetch_misses"] > 0  # counted, with their bytes, not silently dropped
    assert torch.equal(out.sequences, reference.sequences)


def test_a_failure_entering_streaming_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    """Regression: ``streaming()`` changed the user's model before its ``try``, so an error there left the
    model switched."""
    model = tiny_model("llama")
    cache = TieredCache(gpu_gb="1MB", block_tokens=4)

    def broken(name):
        raise RuntimeError("no such attention")

    monkeypatch.setattr(model, "set_attn_implementation", broken)
    with pytest.raises(RuntimeError, match="no such attention"), cache.streaming(model):
        pass
    assert model.config._attn_implementation == "sdpa"
    assert id(model) not in attention._HELD and not cache.runtime.modes  # counted nowhere, no mode left pushed
    cache.close()
