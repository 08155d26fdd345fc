"""TieredCache builds its layers from a config across transformers 5.x releases (``get_layer_types_and_kwargs``
returns per-layer dicts in some and one dict of per-layer values in others, e.g. 5.17)."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

from tierkv import hf
from tierkv.hf import TieredCache, sizing


@pytest.mark.parametrize("shape", ["per-layer dicts", "one dict of lists", "one dict of shared values"])
def test_layers_from_config_whatever_the_release_returns(monkeypatch, shape):
    config = tiny_model("gemma2", "eager", 8).config  # layer 0 sliding (window 8), layer 1 full
    types = ["sliding_attention", "full_attention"]
    answers = {
        "per-layer dicts": (types, [{"sliding_window": 8}, {}]),
        "one dict of lists": (types, {"sliding_window": [8, None]}),
        "one dict of shared values": (types, {"sliding_window": 8}),
    }
    monkeypatch.setattr(sizing, "get_layer_types_and_kwargs", lambda text_config: answers[shape])
    cache = TieredCache(gpu_gb="1MB", config=config)
    assert [layer.sliding_window for layer in cache.layers] == [8, None]
    cache.close()


def test_a_release_that_returns_no_types_means_full_attention(monkeypatch):
    config = tiny_model("llama").config
    monkeypatch.setattr(sizing, "get_layer_types_and_kwargs", lambda text_config: (None, {}))
    cache = TieredCache(gpu_gb="1MB", config=config)
    assert len(cache.layers) == config.num_hidden_layers
    assert all(layer.sliding_window is None for layer in cache.layers)
    cache.close()


@pytest.mark.parametrize("family, window, windows", [("gemma2", 8, [8, None]), ("llama", None, [None, None]),
                                                     ("mistral", 8, [8, 8])])
def test_layers_from_config_on_a_release_without_the_helper(monkeypatch, family, window, windows):
    """transformers 5.0 has no ``get_layer_types_and_kwargs``: DynamicCache's own rule is replayed."""
    config = tiny_model(family, "eager", window).config
    monkeypatch.setattr(sizing, "get_layer_types_and_kwargs", None)
    cache = TieredCache(gpu_gb="1MB", config=config)
    assert [layer.sliding_window for layer in cache.layers] == windows
    cache.close()


def test_the_cache_goes_in_by_the_keyword_this_release_takes():
    """Newer 5.x forwards take ``cache=``, earlier ones (5.17) ``past_key_values=`` and would silently ignore a
    ``cache=``: the keyword is read from the model's signature, and a forward through it fills the cache."""
    import inspect

    model = tiny_model("llama")
    keyword = hf.cache_keyword(model)
    assert keyword in inspect.signature(type(model).forward).parameters
    cache = TieredCache(gpu_gb="1MB", config=model.config)
    model(input_ids=torch.tensor([[1, 2, 3]]), **{keyword: cache})
    assert cache.get_seq_length() == 3
    cache.close()


def test_kv_bytes_held_counts_a_sliding_layer_only_up_to_its_window():
    """Gemma2's alternating layers with a 64-token window: at 1,000 tokens half the layers hold 64."""
    config = tiny_model("gemma2", "eager", 64).config
    per_layer = TieredCache.kv_bytes_per_token(config, torch.float32) // config.num_hidden_layers
    sliding = config.layer_types.count("sliding_attention")
    assert 0 < sliding < config.num_hidden_layers
    held = TieredCache.kv_bytes_held(config, 1000, torch.float32)
    assert held == per_layer * (sliding * 64 + (config.num_hidden_layers - sliding) * 1000)
    assert TieredCache.kv_bytes_held(config, 50, torch.float32) == per_layer * 50 * config.num_hidden_layers
    llama = tiny_model("llama").config
    assert TieredCache.kv_bytes_held(llama, 1000) == TieredCache.kv_bytes_per_token(llama) * 1000


def test_a_cache_iterates_as_dynamic_cache_does(tmp_path):
    """``for keys, values, window in cache``: each layer's K/V (read from every tier) and its sliding window."""
    from models import prompt
    from transformers import DynamicCache

    model = tiny_model("gemma2", "eager", 8)
    ids, _ = prompt(1, 20, seed=2)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad(), TieredCache(gpu_gb=f"{sizing_min(model)}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4,
                                      config=model.config) as cache:  # fmt: skip
        model(ids, past_key_values=dynamic)
        model(ids, past_key_values=cache)
        assert cache.stats()["blocks"]["disk"] > 0
        ours, theirs = list(cache), list(dynamic)
    assert len(ours) == len(theirs) == model.config.num_hidden_layers
    for (keys, values, window), (expected_keys, expected_values, expected_window) in zip(ours, theirs):
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
        assert (window is None) == (expected_window is None)
        assert window is None or torch.equal(window, expected_window)


def sizing_min(model) -> int:
    """The device minimum for 24 tokens of ``model``: the rest of the K/V spills to the host and disk."""
    return TieredCache.min_device_bytes(model.config, 24, block_tokens=4, device="cpu")
