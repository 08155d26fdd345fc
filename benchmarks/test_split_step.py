"""Split attention's decode step against DynamicCache and exact gather, every block on the host tier.

    python -m pytest benchmarks/test_split_step.py --benchmark-enable -s -p no:cacheprovider

The tiny 8-layer Llama of ``benchmarks/test_scale.py`` (fp32, 2 KV heads x 16, 16-token blocks) at 1K-64K
tokens, three caches side by side in one run, interleaved over rounds (medians): ``DynamicCache``; exact gather
with its device budget at ``TieredCache.min_device_bytes`` (the rest on the host tier, copied into staging every
step); split with its device budget at ``TieredCache.min_split_device_bytes`` (the host's blocks attended where
they live by the host kernel, merged by log-sum-exp). Targets (issue "attend where the KV lives"): split <= 1.1x
``DynamicCache`` and <= 1.0x gather at every context; split's device minimum at 64K >= 4x below gather's.
Ratios are printed always and asserted only with ``--benchmark-enable``. ``TIERKV_BENCH_SPLIT_TOKENS`` picks the
contexts (e.g. ``1K,4K``).
"""

from __future__ import annotations

import copy

from rich.table import Table
from test_scale import ROUNDS, SCALE_BLOCK, STEPS, WARMUP, _fill, _interleaved, _model, _show, _steps
from transformers import DynamicCache, LlamaConfig

from tierkv import TieredCache
from tierkv.inputs import env_str
from tierkv.units import parse_token_list

CONTEXTS = parse_token_list(env_str("TIERKV_BENCH_SPLIT_TOKENS", "1K,4K,16K,64K"), name="TIERKV_BENCH_SPLIT_TOKENS")
DYNAMIC_TARGET, GATHER_TARGET, MEMORY_TARGET = 1.1, 1.0, 4.0
CHUNK = 256  # prefill chunk: the device minimum holds two (so every full block lands on the host tier)


def _config() -> LlamaConfig:
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       max_position_embeddings=max(CONTEXTS) + 1024)


def test_split_step_against_dynamic_and_gather(benchmark, capsys) -> None:
    config = _config()
    model, token = _model(config)
    split_model = copy.deepcopy(model)  # `cache.split(model)` binds its model to that cache while engaged
    table = Table(title=f"decode step, every block on the host tier, {config.num_hidden_layers} layers, "
                        f"{SCALE_BLOCK}-token blocks (median of interleaved rounds)")
    for column in ("context", "DynamicCache", "gather", "split", "split / Dynamic", "split / gather",
                   "device min gather", "device min split"):
        table.add_column(column, justify="right")
    results: dict[int, dict[str, float]] = {}
    for tokens in CONTEXTS:
        context = tokens - SCALE_BLOCK // 2  # the last block is open, as in decoding
        decoded = (WARMUP + ROUNDS * STEPS) * 3 + 8
        gather_min = TieredCache.min_device_bytes(config, context + decoded, block_tokens=SCALE_BLOCK)
        split_min = TieredCache.min_split_device_bytes(config, block_tokens=SCALE_BLOCK, chunk_tokens=CHUNK)
        dynamic = DynamicCache()
        gather = TieredCache(gpu_gb=f"{gather_min}B", cpu_gb="4GB", block_tokens=SCALE_BLOCK, config=config)
        split = TieredCache(gpu_gb=f"{split_min}B", cpu_gb="4GB", block_tokens=SCALE_BLOCK, config=config)
        try:
            with split.split(split_model, chunk_tokens=CHUNK):
                _fill([dynamic, gather, split], config.num_hidden_layers, 2, 16, context, 1024)
                medians = _interleaved({"dynamic": _steps(model, dynamic, token),
                                        "gather": _steps(model, gather, token),
                                        "split": _steps(split_model, split, token)})
                placed = split.stats()["blocks"]
                assert placed["host"] > placed["device"], placed
        finally:
            gather.close()
            split.close()
        results[tokens] = {"dynamic": medians["split"] / medians["dynamic"],
                           "gather": medians["split"] / medians["gather"], "memory": gather_min / split_min}
        table.add_row(f"{tokens:,}", f"{medians['dynamic'] * 1e3:.2f} ms", f"{medians['gather'] * 1e3:.2f} ms",
                      f"{medians['split'] * 1e3:.2f} ms", f"{results[tokens]['dynamic']:.2f}x",
                      f"{results[tokens]['gather']:.2f}x", f"{gather_min / 2**20:.2f} MiB",
                      f"{split_min / 2**20:.2f} MiB")
    _show(capsys, table)
    benchmark.extra_info.update(ratios={str(k): v for k, v in results.items()})
    benchmark.pedantic(lambda: None, rounds=1)
    if not benchmark.disabled:
        for tokens, ratio in results.items():
            assert ratio["dynamic"] <= DYNAMIC_TARGET, f"{tokens}: split {ratio['dynamic']:.2f}x DynamicCache"
            assert ratio["gather"] <= GATHER_TARGET, f"{tokens}: split {ratio['gather']:.2f}x gather"
        if 65536 in results:
            assert results[65536]["memory"] >= MEMORY_TARGET, results[65536]
