"""A split decode layer-step's fixed cost stays small and flat (issue 28: the split step within 1.1x DynamicCache's
at 1K tokens, where its attention is ~20 µs: what split adds per layer-step is Python and dispatch, not bytes).

On a CPU host a layer-step is one host kernel call over the layer's table across the tiers, prepared once per grid
(:class:`tierkv.attention.split._Combined`, :class:`tierkv.attention.host_kernel.PagedCall`): no checking, no
argument packing, no merge between steps that change no block. The counts are exact, not times:
:func:`sys.setprofile` counts every Python function call and every C function called from Python inside
``SplitAttention.attend`` (tierkv's, numpy's and torch's alike), and a :class:`TorchDispatchMode` every aten op it
dispatches (each one a tensor allocation or a kernel launch). Traced at 64 and at 1,024 blocks per layer of a tiny
2-layer Llama with the layer geometry of ``benchmarks/test_split_step.py`` (2 KV heads x 16, 16-token blocks, the
device at ``min_split_device_bytes``: most blocks on the host tier, the rest and the open tails on the device):

- a step that opens no block column: within :data:`CALLS` (Python and C, the planner's included) and
  :data:`ATEN_OPS` per layer-step, and the same counts at both sizes;
- the step that opens a column (each layer's table built again): at most :data:`CHUNK_CALLS` more calls per
  layer-step at 1,024 blocks than at 64 per chunk the tiers' pools hold more (a larger pool has more chunks; the
  blocks are never looped over). The store's read planner, which every executor calls, is left out of that
  comparison: its plans are per run of slots (docs/architecture.md).

The per-tier calls and log-sum-exp merge this replaced made ~370 calls (~150 of them Python) and 22 aten ops per
layer-step. On failure the message lists the counts by function.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
import transformers
from models import COMMON
from torch.utils._python_dispatch import TorchDispatchMode

from tierkv import TieredCache, accel
from tierkv.attention import host_kernel
from tierkv.attention.split import SplitAttention
from tierkv.blocks import Tier
from tierkv.store import KVStore

BLOCK_TOKENS = 16
FEW, MANY = 64, 1024  # full blocks per layer
CHUNK = 256  # the streaming prefill's chunks: the device minimum holds two
CALLS = 48  # per layer-step without a new column (the path makes 37, 11 of them Python: the kernel, two outputs)
ATEN_OPS = 6  # the path makes 4: the output and log-sum-exp allocated, the output transposed and converted
CHUNK_CALLS = 16  # more calls a new column's layer-step may make per chunk more in the tiers' pools (it makes 12.5)

pytestmark = [
    pytest.mark.skipif(accel.backend(torch.device("cpu")).streams,
                       reason="the one-call path is the CPU host's (on the CUDA stand-in the tiers run concurrently)"),
    pytest.mark.skipif(not host_kernel.available(), reason="the prepared call needs the C kernel"),
]  # fmt: skip


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _profiled(original: Callable, calls: collections.Counter) -> Callable:
    """``SplitAttention.attend`` counting its Python and C calls (setprofile), and the layer-steps. What the store's
    read planner calls (``KVStore.plan_read``: every executor's access and plan) counts as kind "planner"."""
    planner = KVStore.plan_read.__code__
    inside = [0]  # frames of the planner open

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        kind = "planner" if inside[0] else None
        if event == "call":
            calls[(kind or "python", f"{frame.f_code.co_qualname} in {frame.f_code.co_filename}")] += 1
            inside[0] += frame.f_code is planner
        elif event == "c_call":
            calls[(kind or "C", getattr(arg, "__qualname__", repr(arg)))] += 1
        elif event == "return":
            inside[0] -= frame.f_code is planner

    def attend(self: SplitAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls[("layer-steps", "")] += 1
        sys.setprofile(profile)
        try:
            return original(self, *args, **kwargs)
        finally:
            sys.setprofile(None)

    return attend


def _dispatched(original: Callable, ops: collections.Counter) -> Callable:
    """``SplitAttention.attend`` counting its aten ops, and the layer-steps."""

    def attend(self: SplitAttention, *args: Any, **kwargs: Any) -> torch.Tensor:
        ops["layer-steps"] += 1
        with _Ops(ops):
            return original(self, *args, **kwargs)

    return attend


def traced(blocks: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, collections.Counter]:
    """The counts of a decode step's layer-steps at ``blocks`` full blocks per layer of random K/V: ``"calls"`` and
    ``"ops"`` of two steps that open no block column, ``"column"``: the calls of the step that opens one."""
    config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": (blocks + 4) * BLOCK_TOKENS})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gpu = TieredCache.min_split_device_bytes(config, block_tokens=BLOCK_TOKENS, chunk_tokens=CHUNK)
    context = blocks * BLOCK_TOKENS + BLOCK_TOKENS // 2  # the last block open, half full
    generator = torch.Generator().manual_seed(blocks)
    heads, dim = config.num_key_value_heads, config.head_dim
    found: dict[str, collections.Counter] = {}
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="64MB", block_tokens=BLOCK_TOKENS, config=config) as cache, \
            torch.inference_mode(), cache.split(model, chunk_tokens=CHUNK):
        for start in range(0, context, 1024):
            n = min(1024, context - start)
            for layer in range(config.num_hidden_layers):
                kv = torch.randn(1, heads, n, dim, generator=generator)
                cache.update(kv, kv, layer)
        token = torch.tensor([[7]])

        def step() -> None:
            model(input_ids=token, past_key_values=cache)

        step()
        step()  # the layers' tables built, staging and pools settled
        placed = cache.stats()["blocks"]
        assert placed["host"] > placed["device"] > 0 and placed["disk"] == 0, placed  # both tiers in the call
        for name, counting in (("calls", _profiled), ("ops", _dispatched), ("column", _profiled)):
            while name == "column" and cache.store.seq_length(0) % BLOCK_TOKENS:
                step()  # to the step that opens a new block column
            counts = found[name] = collections.Counter()
            with monkeypatch.context() as patch:
                patch.setattr(SplitAttention, "attend", counting(SplitAttention.attend, counts))
                step()
        memory = [cache.store.tiers[tier] for tier in (Tier.DEVICE, Tier.HOST)]
        found["chunks"] = collections.Counter(chunks=sum(len(pool.chunks) for m in memory for pool in m.pools.values()))
        # each layer's table numbers the host's few chunks first: the kernel walks the chunks before an entry's for
        # each one, and the device pool, grown in small chunks at this budget, has many
        assert len(memory[0].pools[cache.store.layouts[0].slot_bytes].chunks) > 2 * len(memory[1].slabs(
            cache.store.layouts[0]))  # fmt: skip
        assert all(entry.pools[0].memory is memory[1] for entry in cache.executors["split"]._here.values())
    return found


def _listing(counts: collections.Counter) -> str:
    return "\n".join(f"  {count:5d}  {kind}: {name}" for (kind, name), count in counts.most_common(40))


def test_a_split_layer_step_makes_few_calls_whatever_the_blocks(monkeypatch):
    few, many = traced(FEW, monkeypatch), traced(MANY, monkeypatch)
    for counts in (few, many):
        calls, ops = counts["calls"], counts["ops"]
        layers = calls[("layer-steps", "")]
        assert layers == ops["layer-steps"] == COMMON["num_hidden_layers"]
        made, aten = (calls.total() - layers) / layers, (ops.total() - layers) / layers
        assert made <= CALLS and aten <= ATEN_OPS, (
            f"a split layer-step makes {made:.1f} calls (<= {CALLS}) and {aten:.1f} aten ops (<= {ATEN_OPS}):\n"
            f"{_listing(calls)}\n{dict(ops)}")
    for name in ("calls", "ops"):
        assert few[name] == many[name], f"at {FEW} blocks per layer:\n{few[name]}\nat {MANY}:\n{many[name]}"
    column = {size: collections.Counter({k: v for k, v in counts["column"].items() if k[0] != "planner"})
              for size, counts in ((FEW, few), (MANY, many))}  # fmt: skip
    grown, chunks = column[MANY].total() - column[FEW].total(), many["chunks"].total() - few["chunks"].total()
    assert grown <= CHUNK_CALLS * max(chunks, 0) * COMMON["num_hidden_layers"], (
        f"a step that opens a column makes {grown} more calls at {MANY} blocks per layer than at {FEW}, with "
        f"{chunks} more chunks:\n{_listing(column[MANY] - column[FEW])}")
