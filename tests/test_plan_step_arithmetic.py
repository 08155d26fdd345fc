"""The planner's step-time inputs recomputed by hand from the documented roofline: each layer reads its weights
and its K/V and does ``batch * (2 * params + 4 * heads * head_dim * tokens)`` FLOPs, the LM head reads its matrix and
does ``2 * batch * vocab * hidden`` FLOPs, each at ``max(bytes / bandwidth, flops / peak) / efficiency``; and the
bytes a step moves down the chain: the new token's K/V leaves the device whenever the KV spills below it."""

from __future__ import annotations

import dataclasses

import pytest

from tierkv.planner import DeviceSpec, build_request, plan

BATCH = 3


def _hand_compute_s(req) -> float:
    model, device = req.model, req.device

    def roofline(nbytes: float, flops: float) -> float:
        return max(nbytes / device.memory_bandwidth_bytes_per_s, flops / device.peak_flops) / device.efficiency

    total = 0.0
    for layer in range(model.layers):
        tokens = model.tokens_held(layer, req.context)
        nbytes = model.params_per_layer * model.dtype_bytes + BATCH * tokens * model.kv_bytes_per_token_per_layer
        flops = BATCH * (2 * model.params_per_layer + 4 * model.attention_heads * model.head_dim * tokens)
        total += roofline(nbytes, flops)
    head = model.vocab_size * model.hidden_size
    return total + roofline(head * model.dtype_bytes, 2 * BATCH * head)


@pytest.mark.parametrize("device", [
    DeviceSpec("flop-bound", memory_bandwidth_bytes_per_s=1e18, peak_flops=1e9, efficiency=0.5),
    DeviceSpec("memory-bound", memory_bandwidth_bytes_per_s=1e9, peak_flops=1e18, efficiency=0.5),
], ids=lambda d: d.name)
def test_compute_per_step_is_the_roofline_of_every_layer_and_the_lm_head(device):
    req = dataclasses.replace(build_request("llama-3-8b", "8K", gpu=40, cpu=16, batch=BATCH), device=device)
    result = plan(req)
    assert result.bytes_per_tier.host == result.bytes_per_tier.disk == 0
    assert result.compute_s_per_step == pytest.approx(_hand_compute_s(req), rel=1e-9)


def test_the_new_tokens_kv_goes_down_when_the_host_holds_part_of_the_kv():
    result = plan(build_request("llama-3-8b", "1M", gpu=20, cpu=136, batch=1))
    tiers, moved = result.bytes_per_tier, result.bytes_moved_per_step
    assert tiers.host > 0 and tiers.disk == 0
    assert moved["device->host"] == result.kv_bytes_per_token  # 128 KiB: one token of every layer
    assert moved["host->disk"] == 0


def test_nothing_goes_down_when_the_device_holds_everything():
    result = plan(build_request("llama-3-8b", "8K", gpu=40, cpu=16, batch=1))
    assert result.bytes_moved_per_step["device->host"] == 0
