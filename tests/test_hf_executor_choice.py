"""``cache.exact(model)``: exact gather or split, whichever the measured profile says is faster here; outputs equal
``DynamicCache``'s either way."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache, accel
from tierkv.bandwidth import HostAttention, LinkProfile
from tierkv.errors import InvalidConfigError
from tierkv.hf.choice import choose_executor
from tierkv.stats import default_profile


def measured(host_attention_share: float) -> LinkProfile:
    """The CPU-only presets with a host-kernel rate of ``host_attention_share`` x the memcpy rate."""
    presets = default_profile("cpu")
    rate = presets.links["host->host"].bandwidth_bytes_per_s * host_attention_share
    return dataclasses.replace(presets, host_attention=HostAttention(rate, rate / 2, 2))


def test_auto_picks_split_only_where_a_measured_rate_beats_gathers_copy_and_read():
    # gather costs a copy (device->device) and a read (host->host), both at the memcpy preset here: 2 / memcpy
    assert choose_executor(measured(1.0), accelerated=False, kernel_available=True) == "split"
    assert choose_executor(measured(0.4), accelerated=False, kernel_available=True) == "gather"
    assert choose_executor(default_profile("cpu"), accelerated=False, kernel_available=True) == "gather"  # presets
    assert choose_executor(measured(1.0), accelerated=False, kernel_available=False) == "gather"  # no C kernel
    assert choose_executor(measured(1.0), accelerated=True, kernel_available=True) == "gather"  # GPU: the plan
    assert choose_executor(default_profile("cpu"), False, "split") == "split"
    assert choose_executor(measured(1.0), False, "gather") == "gather"
    with pytest.raises(InvalidConfigError, match="not an exact executor"):
        choose_executor(measured(1.0), False, "streaming")


@pytest.mark.parametrize(("share", "chunk", "expected"), [(1.0, 8, "split"), (0.4, 8, "gather"),
                                                          (1.0, 4096, "gather")])  # split's prefill would not fit
def test_exact_decodes_with_the_chosen_executor(tmp_path, monkeypatch, share, chunk, expected):
    from tierkv.attention import host_kernel

    monkeypatch.setattr(host_kernel, "available", lambda: True)  # the torch fallback stands in where C cannot
    if accel.backend(torch.device("cpu")).streams:  # the CUDA stand-in: an accelerator, where the plan decides
        expected = "gather"
    model = tiny_model("llama")
    ids, _ = prompt(1, 40, seed=7)
    reference = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache())
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config,
                     profile=measured(share)) as cache, cache.exact(model, chunk_tokens=chunk):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
        assert cache.chosen == expected
        assert ("split" in cache.executors) == (expected == "split")
    assert torch.equal(out, reference)
