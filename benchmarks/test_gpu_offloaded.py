"""On a GPU: tierkv beside Hugging Face's own offloaded caches, the same model fed the same tokens.

transformers offloads K/V with ``DynamicCache(offloading=True)`` (formerly ``OffloadedCache``) and
``StaticCache(offloading=True)`` (formerly ``OffloadedStaticCache``): every layer's K/V lives in CPU memory and is
copied up to the GPU before its attention (prefetched one layer ahead) and back down after it, every step. tierkv
at the same device memory class keeps the blocks where they are and copies only what the step attends (exact
gather), or attends the host's share on the CPU (split); with a larger device budget part of the K/V never leaves
the GPU.

A Llama built from a config with Llama-3.1-8B's attention geometry (hidden 4096, 32 query heads, 8 KV heads,
head_dim 128, MLP 14336), :data:`LAYERS` layers, random weights (nothing is downloaded), bf16, batch 1; at each
context (``TIERKV_BENCH_OFFLOADED_CONTEXTS``, default 8K and 32K tokens) every cache is prefilled with the same
prompt, then all decode the tokens the all-on-GPU ``DynamicCache`` picks greedily, in interleaved rounds. Printed
per cache: device memory it holds after the prefill and at its peak during the decode steps (the model's own
weights excluded; the peak is the resident memory plus the most a step allocated), the median step and its ratio to
``DynamicCache`` and to HF's offloaded ``DynamicCache``. Asserted: every cache picks the reference's token at every
step (split, whose host share is summed in another order in fp32, may part only at a near tie of the reference's
bf16 logits), and tierkv's caches at their minimum placed most of the K/V off the GPU. Timings are a measurement on
the lent GPU, not asserted.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

from tierkv import TieredCache
from tierkv.inputs import env_str

pytestmark = pytest.mark.cuda

LAYERS, BLOCK = 8, 256
WARMUP, ROUNDS, STEPS = 2, 5, 4
NEAR_TIE = 0.0625  # bf16 logits this close may swap under split's fp32 sums (two bf16 ulps at |logit| ~ 4)
MiB = 2**20

Built = tuple[object, contextlib.AbstractContextManager]  # a cache and the mode it decodes in


def _contexts() -> list[int]:
    raw = env_str("TIERKV_BENCH_OFFLOADED_CONTEXTS", "8K,32K")
    return [int(part.upper().removesuffix("K")) * 1024 for part in raw.split(",")]


def _config(context: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=LAYERS,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=context + 1024, pad_token_id=0, bos_token_id=None, eos_token_id=None)


class _Run:
    """One cache under test: built and prefilled on demand, then stepped on the shared token stream."""

    def __init__(self, name: str, build: Callable[[], Built]) -> None:
        self.name, self.build = name, build
        self.cache: object = None
        self.mode: contextlib.AbstractContextManager = contextlib.nullcontext()
        self.resident = self.peak = 0
        self.times: list[float] = []
        self.picked: list[int] = []
        self.fed = 0

    def prefill(self, model: LlamaForCausalLM, ids: torch.Tensor) -> None:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        self.cache, self.mode = self.build()
        self.mode.__enter__()
        model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        self.resident = torch.cuda.memory_allocated() - before

    def step(self, model: LlamaForCausalLM, token: int, timed: bool) -> torch.Tensor:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        logits = model(input_ids=torch.tensor([[token]], device="cuda"), past_key_values=self.cache,
                       use_cache=True).logits[0, -1]
        torch.cuda.synchronize()
        if timed:
            self.times.append(time.perf_counter() - start)
        self.peak = max(self.peak, self.resident + torch.cuda.max_memory_allocated() - before)
        self.fed += 1
        return logits

    def close(self) -> None:
        self.mode.__exit__(None, None, None)
        if isinstance(self.cache, TieredCache):
            self.cache.close()
        self.cache = None


def _runs(model: LlamaForCausalLM, config: LlamaConfig, context: int, tmp_path) -> list[_Run]:
    length = context + WARMUP + ROUNDS * STEPS + 8
    kv = TieredCache.kv_bytes_per_token(config, torch.bfloat16) * length
    gather_min = TieredCache.min_device_bytes(config, length, block_tokens=BLOCK, dtype=torch.bfloat16,
                                              device="cuda")
    split_min = TieredCache.min_split_device_bytes(config, block_tokens=BLOCK, dtype=torch.bfloat16, device="cuda")

    def tiered(gpu: int, name: str, split: bool = False) -> Callable[[], Built]:
        def build() -> Built:
            cache = TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{kv + kv // 4}B", disk_dir=tmp_path / name,
                                block_tokens=BLOCK, config=config)
            return cache, cache.split(model) if split else contextlib.nullcontext()
        return build

    return [
        _Run("DynamicCache (all on GPU)", lambda: (DynamicCache(config=config), contextlib.nullcontext())),
        _Run("HF DynamicCache(offloading=True)",
             lambda: (DynamicCache(config=config, offloading=True), contextlib.nullcontext())),
        _Run("HF StaticCache(offloading=True)",
             lambda: (StaticCache(config=config, max_cache_len=length, offloading=True), contextlib.nullcontext())),
        _Run("tierkv gather, device at its minimum", tiered(gather_min, "gather-min")),
        _Run("tierkv gather, half the KV on GPU", tiered(gather_min + kv // 2, "gather-half")),
        _Run("tierkv split, device at its minimum", tiered(split_min, "split-min", split=True)),
    ]


@contextlib.contextmanager
def _closing(runs: list[_Run]) -> Iterator[list[_Run]]:
    try:
        yield runs
    finally:
        for run in runs:
            if run.cache is not None:
                run.close()


def _agrees(run: _Run, logits: torch.Tensor, reference: torch.Tensor, step: int) -> float:
    """Asserts ``run`` picks the reference's token (split: unless at a near tie); the largest logit difference."""
    picked, expected = int(logits.argmax()), int(reference.argmax())
    if picked != expected:
        top2 = reference.float().topk(2).values
        gap = float(top2[0] - top2[1])
        assert "split" in run.name and gap < NEAR_TIE, \
            f"{run.name}: step {step} picked {picked}, DynamicCache {expected} (reference top-2 gap {gap:.3g})"
    return float((logits.float() - reference.float()).abs().max())


def test_tierkv_beside_hf_offloaded_caches(tmp_path, capsys):
    lines = []
    torch.manual_seed(0)
    contexts = _contexts()
    config = _config(max(contexts))
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    for context in contexts:
        ids = torch.randint(0, config.vocab_size, (1, context), device="cuda",
                            generator=torch.Generator("cuda").manual_seed(context))
        with torch.inference_mode(), _closing(_runs(model, config, context, tmp_path / str(context))) as runs:
            for run in runs:
                run.prefill(model, ids)
            reference, others = runs[0], runs[1:]
            token, worst = int(ids[0, -1]), {run.name: 0.0 for run in others}
            for step in range(WARMUP + ROUNDS * STEPS):
                timed = step >= WARMUP
                expected = reference.step(model, token, timed)
                for run in others:
                    worst[run.name] = max(worst[run.name], _agrees(run, run.step(model, token, timed), expected, step))
                token = int(expected.argmax())
            blocks = {run.name: run.cache.stats()["blocks"] for run in others if isinstance(run.cache, TieredCache)}
            kv = TieredCache.kv_bytes_per_token(config, torch.bfloat16) * (context + reference.fed)
            base = statistics.median(reference.times)
            offloaded = statistics.median(runs[1].times)
            lines.append(f"\n{context:,} tokens, {LAYERS} layers of Llama-3.1-8B's attention shape, bf16: "
                         f"{kv / MiB:,.0f} MiB of K/V; {torch.cuda.get_device_name()}")
            lines.append(f"  {'cache':40} {'device MiB (resident / peak)':>28} {'step ms':>9} "
                         f"{'x DynamicCache':>15} {'x HF offloaded':>15}  max |dlogit|  blocks device/host/disk")
            for run in runs:
                step_s = statistics.median(run.times)
                placed = blocks.get(run.name)
                where = f"{placed['device']}/{placed['host']}/{placed['disk']}" if placed else ""
                lines.append(f"  {run.name:40} {run.resident / MiB:>13,.0f} / {run.peak / MiB:>12,.0f} "
                             f"{step_s * 1e3:>9.2f} {step_s / base:>14.2f}x {step_s / offloaded:>14.2f}x  "
                             f"{worst.get(run.name, 0.0):>12.3g}  {where}")
            for name, placed in blocks.items():
                off = placed["host"] + placed["disk"]
                assert "minimum" not in name or off > placed["device"], f"{name}: most K/V should be off the GPU"
    with capsys.disabled():
        print("\n".join(lines))
