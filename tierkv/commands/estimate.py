"""How long a command's phases will take on this host, said before they start (``tierkv demo``, ``tierkv eval``).

:func:`measure_cpu` times a float32 matmul and a memory copy (0.1-0.5 s) and returns the host as a
:class:`~tierkv.planner.DeviceSpec`; ``tierkv bench`` records the same numbers in its profile, where
``tierkv plan --device cpu`` reads them. :func:`forward_s` is the roofline of one forward pass of a model on
that spec: the weights read once, ``2 * params`` FLOPs per token, and attention over the tokens before it.
Estimates are rough (a factor of two either way), and are printed as such.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tierkv.planner import CPU_PRESET, DeviceSpec


def _best_of(repeats: int, work) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def measure_cpu(size: int = 768, copy_bytes: int = 64 * 2**20, repeats: int = 5) -> DeviceSpec:
    """This host's float32 matmul FLOP/s (a ``size`` x ``size`` product) and memory copy bandwidth (a copy of
    ``copy_bytes``), best of ``repeats`` each (the run least slowed by other work), as a CPU
    :class:`DeviceSpec` with the CPU preset's efficiency."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    flops = 2 * size**3 / max(_best_of(repeats, lambda: a @ b), 1e-9)
    source = torch.empty(copy_bytes // 4)
    target = torch.empty_like(source)
    bandwidth = copy_bytes / max(_best_of(repeats, lambda: target.copy_(source)), 1e-9)
    return DeviceSpec("cpu, measured", bandwidth, flops, CPU_PRESET.efficiency)


def model_shape(model: torch.nn.Module) -> tuple[int, int, int, int, int]:
    """``(parameters, layers, attention heads, KV heads, head dim)`` of a transformers decoder."""
    model_config: Any = model.config
    config = model_config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return sum(p.numel() for p in model.parameters()), config.num_hidden_layers, heads, kv_heads, head_dim


def forward_s(model: torch.nn.Module, device: DeviceSpec, new_tokens: int, context: int) -> float:
    """Roofline time of one forward of ``new_tokens`` tokens after ``context`` tokens (a prefill chunk, or a
    decode step with ``new_tokens=1``)."""
    params, layers, heads, kv_heads, head_dim = model_shape(model)
    attended = context * new_tokens + new_tokens * (new_tokens + 1) // 2
    flops = 2 * params * new_tokens + 4 * layers * heads * head_dim * attended  # every query head scores
    kv_bytes = 2 * layers * kv_heads * head_dim * 4 * (context + new_tokens)  # a query group reads its KV head once
    return device.time(4 * params + kv_bytes, flops)


def greedy_s(model: torch.nn.Module, device: DeviceSpec, prompt: int, decode: int, chunk: int) -> tuple[float, float]:
    """``(prefill_s, decode_s)`` of prefilling ``prompt`` tokens in chunks of ``chunk``, then ``decode`` steps."""
    prefill = sum(forward_s(model, device, min(chunk, prompt - start), start) for start in range(0, prompt, chunk))
    step = forward_s(model, device, 1, prompt + decode // 2)
    return prefill, step * max(decode - 1, 0)
