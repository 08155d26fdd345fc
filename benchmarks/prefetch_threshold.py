"""Prefetch or read when the layer comes: one decode step of the same cache both ways, against DynamicCache.

The exact executor hands the next layer's read to the mover only where the read weighs at least ``prefetch_min``
(its bytes and ``BLOCK_GATHER_BYTES`` a block, ``tierkv/attention/exact_gather.py``): below that, the hand-off
costs more than the copy it overlaps. This times, interleaved in one process, ``DynamicCache`` and two caches
prefilled alike, one that prefetches every layer (``prefetch_min`` 0) and one that never does, on the tiny 8-layer
Llama of ``benchmarks/test_scale.py`` (one torch thread), and prints which way each shape and size is faster::

    python benchmarks/prefetch_threshold.py 1x16:1024 2x16:256 2x16:512 4x64:64 4x64:128 --placement min

``KVxDIM:BLOCKS``: KV heads, head dim, 16-token blocks per layer; ``--placement all`` (every block on the device
tier) or ``min`` (the device at ``TieredCache.min_device_bytes``, the rest on the host tier).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_scale import SCALE_BLOCK, _fill, _model, _scale_config  # noqa: E402

from tierkv import TieredCache, settings  # noqa: E402
from tierkv.attention.exact_gather import BLOCK_GATHER_BYTES  # noqa: E402

ROUNDS, STEPS = 8, 3


def _steps(model: torch.nn.Module, cache: object, token: torch.Tensor, n: int) -> list[float]:
    times = []
    with torch.inference_mode():
        for _ in range(n):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def measure(kv_heads: int, head_dim: int, blocks: int, placement: str) -> str:
    config = _scale_config(kv_heads, head_dim)
    model, token = _model(config)
    context = blocks * SCALE_BLOCK - SCALE_BLOCK // 2
    caches: dict[str, object] = {"DynamicCache": DynamicCache()}
    _fill([caches["DynamicCache"]], config.num_hidden_layers, kv_heads, head_dim, context, 1024)
    minimum = TieredCache.min_device_bytes(config, context + 200, block_tokens=SCALE_BLOCK)
    gpu, cpu = ("4GB", "64MB") if placement == "all" else (f"{minimum}B", "4GB")
    for name, threshold in (("prefetched", 0), ("read when it comes", 64 << 30)):
        with settings.override(prefetch_min=threshold):  # read when the executor is built: at the first forward
            cache = caches[name] = TieredCache(gpu_gb=gpu, cpu_gb=cpu, block_tokens=SCALE_BLOCK, config=config)
            _fill([cache], config.num_hidden_layers, kv_heads, head_dim, context, 1024)
            _steps(model, cache, token, 1)
    for cache in caches.values():
        _steps(model, cache, token, 2)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(ROUNDS):
        for name, cache in caches.items():
            times[name] += _steps(model, cache, token, STEPS)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for cache in caches.values():
        if isinstance(cache, TieredCache):
            cache.close()
    layer_bytes = context * kv_heads * head_dim * 2 * 4
    weight = blocks * (SCALE_BLOCK * kv_heads * head_dim * 2 * 4 + BLOCK_GATHER_BYTES)  # as the executor weighs it
    ratios = {name: medians[name] / medians["DynamicCache"] for name in ("prefetched", "read when it comes")}
    faster = min(ratios, key=ratios.__getitem__)
    chosen = "prefetched" if weight >= settings.get("prefetch_min") else "read when it comes"
    return (f"{kv_heads}x{head_dim}, {blocks:,} blocks, {placement}: {layer_bytes / 2**20:.1f} MiB a layer (weighs "
            f"{weight / 2**20:.1f} MiB); DynamicCache {medians['DynamicCache'] * 1e3:.2f} ms; prefetched "
            f"{ratios['prefetched']:.2f}x, read when it comes {ratios['read when it comes']:.2f}x: {faster} is "
            f"faster; the default chooses {chosen}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="+", help="KVxDIM:BLOCKS, e.g. 1x16:1024")
    parser.add_argument("--placement", choices=("all", "min"), default="all")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for shape in args.shapes:
        heads, _, rest = shape.partition("x")
        dim, _, blocks = rest.partition(":")
        print(measure(int(heads), int(dim), int(blocks), args.placement), flush=True)


if __name__ == "__main__":
    main()
