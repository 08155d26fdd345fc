"""``tierkv plan`` against the runtime it plans for: the same device minimums as TieredCache's sizing, the prefetch
depth the cache decodes at, the prefill peak of sliding-window layers, and the inputs a plan takes from a profile."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from tierkv import TieredCache
from tierkv.bandwidth import MAX_MEMORY_LATENCY_S, Link
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError, TierKVError
from tierkv.planner import (
    MEMCPY_TRAFFIC,
    _lm_head_s,
    build_request,
    compute_s_per_layer,
    cpu_device,
    min_device_bytes,
    plan,
)
from tierkv.stats import default_profile
from tierkv.units import format_size_option
from tierkv.vocabulary import LinkName

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            vocab_size=512, max_position_embeddings=32768, dtype="float32")


def _llama(layers: int = 4) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(num_hidden_layers=layers, **TINY)


def _gemma(layers: int = 4, window: int = 256) -> transformers.Gemma3TextConfig:
    """Every layer but the last slides over ``window`` tokens."""
    return transformers.Gemma3TextConfig(num_hidden_layers=layers, sliding_window=window,
                                         layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], **TINY)


def _request(config, tmp_path, context: int, gpu: int, cpu: int, **options):
    config.save_pretrained(tmp_path)
    return build_request(str(tmp_path / "config.json"), context, gpu=f"{gpu}B", cpu=f"{cpu}B", device="cpu",
                         **options)


@pytest.mark.parametrize("config", [_llama(), _gemma()], ids=["full", "sliding"])
@pytest.mark.parametrize(("context", "batch"), [(1024, 1), (8195, 2)])
def test_every_executors_minimum_is_the_runtimes_and_the_plan_refuses_only_below_it(config, context, batch, tmp_path):
    """Staging beside the open tail blocks under the slab rule, and sparse's selection growth, backfill column and
    grown summary tables: the planner's minimum is TieredCache's, and a plan fits from exactly that budget."""
    runtime = {
        "gather": TieredCache.min_device_bytes(config, context, batch=batch, prefetch_depth=0, device="cpu"),
        "streaming": TieredCache.min_streaming_device_bytes(config, batch=batch, chunk_tokens=4096, device="cpu"),
        "sparse": TieredCache.min_sparse_device_bytes(config, context, tokens=2048, batch=batch, rest_bits=4,
                                                      chunk_tokens=4096, device="cpu"),
        "split": TieredCache.min_split_device_bytes(config, batch=batch, chunk_tokens=4096, device="cpu"),
    }
    for executor, least in runtime.items():
        req = _request(config, tmp_path, context, least, 2**30, batch=batch, executor=executor, prefetch_depth=0
                       if executor == "gather" else None, sparse_tokens=2048, sparse_rest_bits=4)
        assert min_device_bytes(req, 0) == least, executor
        assert plan(req).request.gpu_bytes == least
        with pytest.raises(BudgetTooSmallError):
            plan(dataclasses.replace(req, gpu_bytes=least - 1))
    deeper = TieredCache.min_device_bytes(config, context, batch=batch, prefetch_depth=3, device="cpu")
    assert min_device_bytes(dataclasses.replace(req, executor="gather"), 3) == deeper


def _decode(model, cache, prompt: int, steps: int = 3) -> None:
    with torch.no_grad():
        out = model(input_ids=torch.randint(1, 500, (1, prompt)), past_key_values=cache)
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)


def test_gather_between_the_depth_minimums_decodes_without_prefetch_as_the_runtime(tmp_path):
    """Below depth 1's minimum (``min_device_bytes``, with the staging's growth headroom) the cache turns prefetch off
    rather than refuse once its staging outgrows the budget; the plan prices depth 0 there, and below depth 0's
    minimum it refuses naming both budgets."""
    torch.manual_seed(0)
    config = _llama()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    context = 1024 + 4
    floor = TieredCache.min_device_bytes(config, context, prefetch_depth=0, device="cpu")
    ahead = TieredCache.min_device_bytes(config, context, prefetch_depth=1, device="cpu")
    for gpu, depth in ((floor, 0), (ahead, 1)):
        planned = plan(_request(config, tmp_path, context, gpu, 2**30))
        with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="1GB", config=model.config) as cache:
            _decode(model, cache, 1024)
            assert cache.stats()["prefetch_depth"] == planned.forecast.prefetch_depth == depth
    with pytest.raises(BudgetTooSmallError) as info:
        plan(_request(config, tmp_path, context, floor - 1, 2**30))
    assert (f"at least {format_size_option(floor)} to decode with prefetch off (slower), "
            f"{format_size_option(ahead)} to read 1 layer ahead") in str(info.value)


def _runs(model, gpu: int, cpu: int, prompt: int) -> bool:
    try:
        with TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", config=model.config) as cache:
            _decode(model, cache, prompt)
    except TierKVError:
        return False
    return True


def test_sliding_layers_hold_the_whole_prompt_at_the_prefill(tmp_path):
    """Three of four layers slide over 256 tokens, but until the first decode step every layer holds the 2K-token
    prompt: host memory for the decode steady state is refused by the cache at the prefill, and by the plan; the
    least the plan takes, the cache runs."""
    torch.manual_seed(0)
    config = _gemma()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt, context = 2048, 2048 + 4
    gpu = TieredCache.min_device_bytes(config, context, device="cpu")
    decoding = plan(_request(config, tmp_path, context, gpu, 2**30)).kv_bytes_total
    with pytest.raises(CapacityError, match="at the prefill"):
        plan(_request(config, tmp_path, context, gpu, decoding, disk="0B"))
    assert not _runs(model, gpu, decoding, prompt)
    low, high = 0, 4 * decoding
    while low < high:  # the least host budget the plan takes
        middle = (low + high) // 2
        try:
            plan(_request(config, tmp_path, context, gpu, middle, disk="0B"))
            high = middle
        except CapacityError:
            low = middle + 1
    fits = plan(_request(config, tmp_path, context, gpu, low, disk="0B"))
    assert any(note.startswith("sliding layers hold the whole prompt until the first decode step")
               for note in fits.notes)
    assert _runs(model, gpu, low, prompt)


def test_measured_compute_of_split_counts_attention_once():
    """Given the roofline's own exact-decoding compute as a measurement, split prices the same device part as from
    the roofline (the layers without the attention the host kernel does), not the whole measurement."""
    req = build_request("smollm2-135m", "16K", gpu="100MB", cpu=4, device="cpu", executor="split")
    roofline = plan(req)
    exact = sum(compute_s_per_layer(req.model, req.context, req.batch, req.device))
    measured = plan(dataclasses.replace(req, compute_s_per_step=exact))
    assert measured.compute_s_per_step < exact
    assert measured.compute_s_per_step == pytest.approx(
        roofline.compute_s_per_step - _lm_head_s(req.model, req.batch, req.device))  # (a measurement includes it)
    assert measured.forecast.host_attention_s == pytest.approx(roofline.forecast.host_attention_s)


def _cpu_profile(tmp_path, **links: Link):
    path = tmp_path / "cpu.json"
    profile = default_profile("cpu")
    profile = dataclasses.replace(profile.replace(**links), machine={"compute_flops": "2.6e10", "gpu": "none"})
    profile.save(path)
    return str(path)


def test_a_cpu_only_profile_takes_no_pcie_link_and_plans_the_cpu(tmp_path):
    path = _cpu_profile(tmp_path)
    with pytest.raises(InvalidConfigError, match="CPU-only host.*leave --link out"):
        build_request("demo", "4K", gpu="60MB", cpu="20MB", profile=path, link="pcie5")
    assert build_request("demo", "4K", gpu="60MB", cpu="20MB", profile=path).device.name == "cpu, measured"


def test_the_cpu_reads_memory_at_twice_its_memcpy_rate_and_a_busy_hosts_latency_is_capped(tmp_path):
    """A memcpy reads and writes each byte; measured rates are reached ones (efficiency 1). A fitted 12 ms per copy
    within memory is a busy host's noise: planned with 1 ms, and said."""
    busy = Link("host->device", 0.94e9, 0.012)
    path = _cpu_profile(tmp_path, **{LinkName.HOST_TO_DEVICE: busy})
    req = build_request("demo", "4K", gpu="60MB", cpu="20MB", profile=path)
    memcpy = req.links.links[LinkName.HOST_TO_HOST].bandwidth_bytes_per_s
    assert cpu_device(req.links) == req.device
    assert req.device.memory_bandwidth_bytes_per_s == MEMCPY_TRAFFIC * memcpy == 2 * memcpy
    assert req.device.efficiency == 1.0 and req.device.peak_flops == 2.6e10
    assert req.links.links[LinkName.HOST_TO_DEVICE].latency_s == MAX_MEMORY_LATENCY_S
    assert any("host->device latency 12 ms" in note for note in plan(req).notes)
    assert json.loads(json.dumps(plan(req).to_dict()))["links"]["host->device"]["latency_s"] == MAX_MEMORY_LATENCY_S
