"""The split executor's CUDA path: the device's share attended on the GPU, the host's and the disk's on the CPU
with the host kernel (only the query goes down, (out, lse) comes up), merged by log-sum-exp, against
DynamicCache on the GPU; and one decode step's time against exact gather's and DynamicCache's, printed for
``benchmarks/gpu_check.sh`` (not asserted: one short run on a lent GPU is a measurement, not a test)."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from tierkv import TieredCache

pytestmark = pytest.mark.cuda


def _gpu_model(layers: int = 3, hidden: int = 128, heads: int = 4) -> tuple[LlamaConfig, LlamaForCausalLM]:
    """A small seeded GQA Llama (two query heads per kv head) on the GPU."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2)  # fmt: skip
    return config, LlamaForCausalLM(config).cuda().eval()


def test_split_on_gpu_matches_dynamic_cache_within_the_split_minimum(tmp_path):
    """Batch of two, blocks on all three tiers, the device at the split minimum plus a few blocks (the device
    share's bounded scratch included, no staging of the layer): tokens equal and logits within 1e-4 of
    DynamicCache."""
    config, model = _gpu_model()
    ids = torch.randint(0, 256, (2, 300), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
    reference = model.generate(ids, past_key_values=DynamicCache(), **kwargs)
    budget = TieredCache.min_split_device_bytes(config, 2, block_tokens=16, chunk_tokens=64) + 64 * 1024
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="128KB", disk_dir=tmp_path, block_tokens=16,
                     config=config) as cache, cache.split(model, chunk_tokens=64):  # fmt: skip
        out = model.generate(ids, past_key_values=cache, **kwargs)
        stats = cache.stats()
    assert stats["mover"] == "cuda-stream"
    assert stats["blocks"]["device"] > 0 and stats["blocks"]["host"] > 0 and stats["blocks"]["disk"] > 0
    assert stats["peak_bytes_allocated"]["device"] <= budget
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(out.logits, reference.logits):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def _step_seconds(model: LlamaForCausalLM, ids: torch.Tensor, cache: object, steps: int = 16) -> float:
    """Mean seconds of ``steps`` greedy one-token forwards, after the prefill and two warm-up steps."""
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for i in range(steps + 2):
            if i == 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def test_split_step_time_beside_exact_gather(tmp_path):
    """Every block on the host tier (8K tokens of a 4-layer GQA model): one decode step with split (device at
    its minimum) beside exact gather (device at its minimum: the staging buffers) and DynamicCache, printed."""
    config, model = _gpu_model(layers=4, hidden=512, heads=8)
    context = 8192
    ids = torch.randint(0, 256, (1, context), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    times = {"DynamicCache": _step_seconds(model, ids, DynamicCache())}
    gather_budget = TieredCache.min_device_bytes(config, context + 32, block_tokens=256, device="cuda")
    with TieredCache(gpu_gb=f"{gather_budget}B", cpu_gb=4, disk_dir=tmp_path / "gather", config=config) as cache:
        times["exact gather"] = _step_seconds(model, ids, cache)
        gather_stats = cache.stats()
    split_budget = TieredCache.min_split_device_bytes(config, 1, block_tokens=256, chunk_tokens=512)
    with TieredCache(gpu_gb=f"{split_budget}B", cpu_gb=4, disk_dir=tmp_path / "split", config=config) as cache, \
            cache.split(model, chunk_tokens=512):  # fmt: skip
        times["split"] = _step_seconds(model, ids, cache)
        split_stats = cache.stats()
    print(f"\nsplit on CUDA, {context} tokens, 4 layers, 8 q / 4 kv heads, head_dim 64, fp32, batch 1:")
    print(f"  device budget: split {split_budget / 2**20:.1f} MiB, exact gather {gather_budget / 2**20:.1f} MiB")
    print(f"  blocks: split {split_stats['blocks']}, exact gather {gather_stats['blocks']}")
    for name, seconds in times.items():
        print(f"  {name:13} {seconds * 1e3:8.2f} ms/step")
    print(f"  split / exact gather: {times['split'] / times['exact gather']:.2f}x (target <= 1.0x); "
          f"split / DynamicCache: {times['split'] / times['DynamicCache']:.2f}x (target <= 1.1x)")  # fmt: skip
    assert split_stats["blocks"]["host"] > 0 and gather_stats["blocks"]["host"] > 0  # the host share was measured
