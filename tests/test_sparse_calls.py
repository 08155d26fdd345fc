"""A sparse decode step's Python work does not grow with the blocks of a layer (issue 30: no per-block or per-page
Python on the hot path; selection plans are numpy/torch).

The same decode step is traced at 128 and at 4,096 blocks per layer, every other thing equal (a tiny 2-layer Llama,
32-token blocks, budgets scaled with the KV so blocks sit on the device, the host and the disk in both: the device
1/2 of the KV besides the streaming minimum, which the summaries, rest copy and staging share; the host 1/4), at the
defaults (``cache.sparse(model, tokens=0.1)``: pages of the default size inside each block). The count is exact, not
a time: :func:`sys.settrace` counts every Python function call of the step (tierkv's, torch's and transformers'
Python alike) and every line tierkv executes. A line event fires for each new line *and* each backward jump, so a
loop over blocks or pages costs at least one event per iteration even when it is a one-line comprehension that calls
nothing. At 4,096 blocks a loop over blocks adds >= 3,968 events per layer, one over the pages a step selects (10%
of 8,192 pages against 10% of 256) ~800 per layer: far above :data:`SLACK`, which absorbs what a step may do a
constant number of times more or less (a staging buffer grown, a speculative read landed or not). On failure the
message lists the functions whose counts grew, with how much: the per-block Python to vectorise. Only the decoding
thread is traced (the mover's and the disk engine's threads run their own loops over requests, not over blocks).

Pages a layer kept from its earlier steps (:mod:`tierkv.attention.kept`) are not read again, so whether a step reads
from some tier at all depends on its hits, not on the block count: the whole step is compared with keeping off (every
tier read in both), and with it on, the kept layers' own work must be exactly equal at both sizes.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import transformers
from models import COMMON

import tierkv
from tierkv import TieredCache
from tierkv.attention import kept as kept_module
from tierkv.attention import sparse_rest as rest_module
from tierkv.tiers import disk as disk_module

PACKAGE = str(Path(tierkv.__file__).resolve().parent) + "/"
BLOCK_TOKENS = 32  # the default pages (16 tokens) are then two per block; small blocks keep 4,096 cheap
FEW, MANY = 128, 4096  # full blocks per layer
SLACK = 250  # events a step may differ by whatever the block count: a tier its selection reads at one size only (~200)
CHUNK = 128  # streaming chunks of the exact (prefill) path: a device floor far below the KV at 128 blocks
WARMUP = 3  # untimed steps first: staging sized, summaries and kept blocks settled


def _model() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 2 * MANY * BLOCK_TOKENS})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def count_events(step: Any) -> collections.Counter:
    """Run ``step()`` traced: ``{(file, function): calls}`` for every Python function the decoding thread calls,
    plus ``{(file, "function (lines)"): lines}`` for every line executed in a tierkv function."""
    counts: collections.Counter = collections.Counter()

    def lines(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            counts[(frame.f_code.co_filename, f"{frame.f_code.co_qualname} (lines)")] += 1
        return lines

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        path = frame.f_code.co_filename
        counts[(path, frame.f_code.co_qualname)] += 1
        return lines if path.startswith(PACKAGE) else None

    sys.settrace(calls)
    try:
        step()
    finally:
        sys.settrace(None)
    return counts


def traced_step(tmp_path: Path, blocks: int, page_tokens: int | None) -> tuple[collections.Counter, dict]:
    """The events of one sparse decode step over ``blocks`` full blocks per layer of random K/V (written as a
    prefill writes them), and the cache's blocks per tier."""
    model = _model()
    config = model.config
    tokens = blocks * BLOCK_TOKENS + 5  # and an open tail
    kv = TieredCache.kv_bytes_per_token(config, torch.float32) * tokens
    gpu = TieredCache.min_streaming_device_bytes(config, block_tokens=BLOCK_TOKENS, chunk_tokens=CHUNK) + kv // 2
    generator = torch.Generator().manual_seed(blocks)
    heads, dim = config.num_key_value_heads, config.head_dim
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{kv // 4}B", disk_dir=tmp_path, block_tokens=BLOCK_TOKENS,
                     config=config) as cache, torch.inference_mode(), \
            cache.sparse(model, tokens=0.1, page_tokens=page_tokens, chunk_tokens=CHUNK):
        for start in range(0, tokens, 4096):
            n = min(4096, tokens - start)
            for layer in range(config.num_hidden_layers):
                cache.update(torch.randn(1, heads, n, dim, generator=generator),
                             torch.randn(1, heads, n, dim, generator=generator), layer)
        token = torch.tensor([[7]])

        def step() -> None:
            nonlocal token
            token = model(input_ids=token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)

        for _ in range(WARMUP):
            step()
        counts = count_events(step)
        placed = cache.stats()["blocks"]
        cache.store.check()  # nothing dropped
    return counts, placed


def _grown(few: collections.Counter, many: collections.Counter) -> str:
    rows = sorted(((many[k] - few.get(k, 0), k) for k in many if many[k] - few.get(k, 0) > 0), reverse=True)
    return "\n".join(f"  +{delta:6d}  {name} in {path.removeprefix(PACKAGE)}" for delta, (path, name) in rows[:20])


def test_python_calls_per_sparse_step_do_not_grow_with_blocks(tmp_path, monkeypatch):
    """At the defaults (pages, the rest copy). The disk bounce buffer is pinned to its full size in both cases and the
    rest copy is attended in one chunk: a larger context's page reads and rest attention then take as many
    rounds as a smaller one's (rounds of a bounded buffer grow with the bytes, not with a loop over blocks).
    Whole-block selection (``page_tokens == block_tokens``) reads through the block planner, whose per-run
    copies are not flat (docs/architecture.md)."""
    monkeypatch.setattr(disk_module, "MIN_BOUNCE_BYTES", disk_module.BOUNCE_BYTES)
    monkeypatch.setattr(rest_module, "REST_CHUNK_TOKENS", 2 * MANY * BLOCK_TOKENS)  # one chunk of the rest copy
    monkeypatch.setattr(kept_module, "KEEP_SHARE", 0.0)  # nothing kept: every step reads every tier (docstring)
    few, few_placed = traced_step(tmp_path / "few", FEW, None)
    many, many_placed = traced_step(tmp_path / "many", MANY, None)
    for placed in (few_placed, many_placed):  # every tier holds blocks in both
        assert all(placed[tier] > 0 for tier in ("device", "host", "disk")), placed
    total_few, total_many = sum(few.values()), sum(many.values())
    assert total_many - total_few <= SLACK, (  # growth: a path taken only at one size may make fewer
        f"a sparse step's Python events: {total_few} at {FEW} blocks per layer, {total_many} at {MANY}; "
        f"grown:\n{_grown(few, many)}")


def test_kept_pages_work_the_same_whatever_the_blocks(tmp_path, monkeypatch):
    """With pages kept across steps (the default), the kept layers' own Python (placing a selection, recording the
    misses read into place, viewing the buffer as the kernel's slab) is the same at 128 and 4,096 blocks per layer,
    and it ran."""
    monkeypatch.setattr(disk_module, "MIN_BOUNCE_BYTES", disk_module.BOUNCE_BYTES)
    monkeypatch.setattr(rest_module, "REST_CHUNK_TOKENS", 2 * MANY * BLOCK_TOKENS)
    kept_file = str(Path(kept_module.__file__).resolve())
    counts = []
    for name, blocks in (("few", FEW), ("many", MANY)):
        events, _ = traced_step(tmp_path / name, blocks, None)
        counts.append({key: n for key, n in events.items() if key[0] == kept_file})
    assert (kept_file, "KeptLayer.place") in counts[0] and (kept_file, "KeptLayer.slab") in counts[0], "no kept layer"
    assert counts[0] == counts[1], _grown(collections.Counter(counts[0]), collections.Counter(counts[1]))
