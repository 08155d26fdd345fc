"""CUDA paths of the cache: device tier in HBM, pinned host tier, stream mover; budget via the allocator."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tierkv import TieredCache

pytestmark = pytest.mark.cuda


def _gpu_model() -> tuple[LlamaConfig, LlamaForCausalLM]:
    """A small seeded GQA Llama on the GPU."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)
    return config, LlamaForCausalLM(config).cuda().eval()


def test_generation_on_gpu_matches_and_respects_budget(tmp_path):
    config, model = _gpu_model()
    ids = torch.randint(0, 256, (1, 200), device="cuda")
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, past_key_values=DynamicCache())
    # the documented minimum on CUDA (landing buffers included) plus two blocks; 216 tokens x 3 layers hold
    # 1.3 MB of KV, so a 64 KB host tier sends most of it to disk
    budget = TieredCache.min_device_bytes(config, 216, block_tokens=16, device="cuda") + 64 * 1024
    before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=16) as cache:
        # on the host: the allocator's count below is the cache's alone
        out = model.generate(ids, max_new_tokens=16, do_sample=False, past_key_values=cache).cpu()
        stats = cache.stats()
        assert stats["mover"] == "cuda-stream"
        assert stats["blocks"]["disk"] > 0 and stats["bytes_moved"]["host->device"] > 0
        assert stats["bytes_moved"]["disk->device"] > 0
        assert cache.store.tiers[1].pools and all(
            chunk.is_pinned() for pool in cache.store.tiers[1].pools.values() for chunk in pool.chunks)
        assert stats["peak_bytes_allocated"]["device"] <= budget  # the cache's own high-water mark
        assert torch.cuda.memory_allocated() - before <= budget  # and what the allocator holds for it now
    assert torch.equal(out, ref.cpu())
    # freed staging and slabs went back to the driver (empty_cache), not into the caching allocator's reserve
    assert torch.cuda.memory_reserved() <= reserved_before


def test_streaming_on_gpu_matches_with_cross_layer_prefetch_and_event_timing(tmp_path):
    """Streaming attention on CUDA: chunk copies on the mover's stream, the next layer's first chunk in
    flight, telemetry timed by CUDA events; tokens equal to DynamicCache."""
    config, model = _gpu_model()
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache())
    budget = TieredCache.min_streaming_device_bytes(config, block_tokens=16, chunk_tokens=64) + 64 * 1024
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=16,
                     config=config) as cache, cache.streaming(model, chunk_tokens=64):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
        stats = cache.stats()
    assert torch.equal(out, ref)
    assert stats["mover"] == "cuda-stream" and stats["blocks"]["disk"] > 0
    assert stats["prefetch_hits"] > 0
    last = stats["steps"]["last"]
    assert last["transfer_s_by_link"]["disk->device"] > 0 and last["predicted_step_s"] > 0


def test_sparse_on_gpu_exact_at_full_budget_and_close_with_a_rest_copy(tmp_path):
    """Sparse attention on CUDA: summaries, staging, kept blocks and the rest copy in HBM, disk blocks read into
    it. A budget covering the context gives DynamicCache's tokens; a small one with an 8-bit rest copy keeps the
    logits far closer to DynamicCache's than without it; the device budget holds either way."""
    config, model = _gpu_model()
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    ref = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache(),
                         output_logits=True, return_dict_in_generate=True)
    budget = TieredCache.min_streaming_device_bytes(config, block_tokens=8, chunk_tokens=64) + 512 * 1024
    errors = {}
    for tokens, bits in ((1.0, 0), (48, 0), (48, 8)):
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb="64KB", disk_dir=tmp_path / f"{tokens}-{bits}",
                         block_tokens=8, config=config) as cache, \
                cache.sparse(model, tokens=tokens, chunk_tokens=64, rest_bits=bits):
            out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache,
                                 output_logits=True, return_dict_in_generate=True)
            stats = cache.stats()
            assert cache.store.summaries.device.type == "cuda"
        assert stats["mover"] == "cuda-stream" and stats["blocks"]["disk"] > 0
        assert stats["peak_bytes_allocated"]["device"] <= budget
        errors[tokens, bits] = max((got - want).abs().max().item() for got, want in zip(out.logits[1:],
                                                                                       ref.logits[1:]))
    assert errors[1.0, 0] < 1e-3, errors  # every block read: exact up to the GPU's float rounding
    assert errors[48, 8] < errors[48, 0] / 50, errors


def test_split_on_gpu_matches_at_its_minimum_and_attends_host_blocks_on_the_cpu(tmp_path):
    """``cache.split`` on CUDA: decode attends the device share from the slab, the host share on the CPU
    (concurrently, on the mover's thread) and the disk share there too; tokens equal to DynamicCache's, the device
    holds no more than ``min_split_device_bytes`` plus a few blocks, whatever the context."""
    config, model = _gpu_model()
    ids = torch.randint(0, 256, (1, 300), device="cuda")
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache())
    budget = TieredCache.min_split_device_bytes(config, block_tokens=16, chunk_tokens=64, device="cuda") + 64 * 1024
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="64KB", disk_dir=tmp_path, block_tokens=16,
                     config=config) as cache, cache.split(model, chunk_tokens=64):
        out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
        stats = cache.stats()
        split = cache.executors["split"]
        assert split.staging.reserved > 0 and not split.staging.buffers  # its scratch is counted, nothing staged
    assert torch.equal(out, ref)
    assert stats["blocks"]["host"] > 0 and stats["blocks"]["disk"] > 0 and stats["bytes_moved"]["disk->host"] > 0
    assert stats["peak_bytes_allocated"]["device"] <= budget
