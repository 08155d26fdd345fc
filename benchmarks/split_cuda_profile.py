"""Where a split decode step goes on a GPU, beside exact gather's: ``python benchmarks/split_cuda_profile.py``.

The scene of ``tests/test_split_cuda.py``'s step time (8K tokens of a 4-layer GQA Llama, every block on the pinned
host tier, the device at each executor's minimum): ten decode steps under cProfile (the top functions by own and
by cumulative time) and five under torch's profiler (CPU and CUDA time per operator), each executor in turn.
``benchmarks/gpu_check.sh`` runs it; it exits at once without CUDA.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM

from tierkv import TieredCache

CONTEXT = 8192


def _profile(model: LlamaForCausalLM, ids: torch.Tensor, cache: TieredCache, steps: int = 10) -> None:
    with torch.no_grad():
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(3):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        profiler.disable()
        seconds = (time.perf_counter() - start) / steps
        print(f"{seconds * 1e3:.2f} ms/step under cProfile; blocks {cache.stats()['blocks']}")
        for key, rows in (("tottime", 30), ("cumulative", 40)):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(rows)
            print(text.getvalue())
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as operators:
            for _ in range(5):
                token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
        for key, rows in (("self_cpu_time_total", 25), ("self_cuda_time_total", 12)):
            print(operators.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main() -> int:
    if not torch.cuda.is_available():
        print("split_cuda_profile: CUDA is not visible to torch; nothing profiled", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    model = LlamaForCausalLM(config).cuda().eval()
    ids = torch.randint(0, 256, (1, CONTEXT), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    print(f"torch threads {torch.get_num_threads()}, {torch.cuda.get_device_name()}")
    with tempfile.TemporaryDirectory() as folder:
        budget = TieredCache.min_split_device_bytes(config, 1, block_tokens=256, chunk_tokens=512)
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb=4, disk_dir=folder, config=config) as cache, \
                cache.split(model, chunk_tokens=512):  # fmt: skip
            print("=== split")
            _profile(model, ids, cache)
    with tempfile.TemporaryDirectory() as folder:
        budget = TieredCache.min_device_bytes(config, CONTEXT + 32, block_tokens=256, device="cuda")
        with TieredCache(gpu_gb=f"{budget}B", cpu_gb=4, disk_dir=folder, config=config) as cache:
            print("=== exact gather")
            _profile(model, ids, cache)
    return 0


if __name__ == "__main__":
    sys.exit(main())
