"""tierkv.hf.layer: one layer's own step and state — what it hands the model, the span its executor gets, the
window it keeps, and how it gives a failed step back — against plain tensors and DynamicCache's layers."""

from __future__ import annotations

import pytest
import torch
from helpers import kv
from transformers.cache_utils import DynamicSlidingWindowLayer

from tierkv import InvalidConfigError, TieredCache, TierKVError
from tierkv.attention.base import Span
from tierkv.attention.exact_gather import ExactGather
from tierkv.hf import TieredLayer


def _sliding_cache(window: int, block_tokens: int = 4) -> TieredCache:
    cache = TieredCache(block_tokens=block_tokens)
    cache.layers = [TieredLayer(cache, 0, window)]
    cache.runtime.num_layers = 1
    return cache


def test_a_step_hands_the_model_every_stored_token():
    with TieredCache(block_tokens=4) as cache:
        first, second = kv(2, 7, seed=1), kv(2, 3, seed=2)
        cache.layers.append(TieredLayer(cache, 0))
        cache.layers[0].update(*first)
        keys, values = cache.layers[0].update(*second)
        assert torch.equal(keys, torch.cat([first[0], second[0]], dim=2))
        assert torch.equal(values, torch.cat([first[1], second[1]], dim=2))
        assert cache.layers[0].get_seq_length() == 10 and cache.layers[0].length_before == 7


def test_the_executor_gets_one_immutable_span(monkeypatch):
    seen: list[Span] = []
    original = ExactGather.step

    def step(self, span, keys, values):
        seen.append(span)
        return original(self, span, keys, values)

    monkeypatch.setattr(ExactGather, "step", step)
    with _sliding_cache(window=6) as cache:
        layer = cache.layers[0]
        for tokens in (5, 1, 1, 1, 1, 1):
            layer.update(*kv(1, tokens, seed=tokens))
        assert [(s.start, s.stop, s.new_tokens, s.context) for s in seen] == \
            [(0, 5, 5, 5), (0, 6, 1, 6), (1, 7, 1, 7), (2, 8, 1, 8), (3, 9, 1, 9), (0, 6, 1, 10)]  # a block dropped
        assert layer.dropped == 4
        assert all(s.window == 6 and s.batch == 1 and s.layer == 0 for s in seen)
        with pytest.raises(AttributeError):
            seen[0].start = 1  # frozen


def test_a_sliding_layer_drops_whole_blocks_and_masks_as_transformers_does():
    window = 6
    reference = DynamicSlidingWindowLayer(window)
    with _sliding_cache(window) as cache:
        layer = cache.layers[0]
        for step in range(12):
            keys, values = kv(1, 3 if step == 0 else 1, seed=step)
            got = layer.update(keys, values)
            expected = reference.update(keys, values)
            visible = got[0].shape[2]
            assert torch.equal(got[0], expected[0][:, :, -visible:])  # the window's tokens, in order
            assert layer.get_seq_length() == reference.get_seq_length()
            assert layer.get_mask_sizes(1) == reference.get_mask_sizes(1)
        assert layer.dropped > 0 and layer.dropped % 4 == 0 and layer.stored() < layer.get_seq_length()
        with pytest.raises(InvalidConfigError, match="at most [0-9]+ can be cropped"):
            layer.crop(-layer.stored())


def test_a_failed_step_is_given_back_by_every_layer(monkeypatch):
    with TieredCache(block_tokens=4) as cache:
        for index in range(2):
            cache.update(*kv(1, 5, seed=index), index)

        def broken(self, span, keys, values):
            raise RuntimeError("executor failed")

        cache.update(*kv(1, 1, seed=7), 0)  # layer 0 took the next step ...
        monkeypatch.setattr(ExactGather, "step", broken)
        with pytest.raises(RuntimeError, match="executor failed"):
            cache.update(*kv(1, 1, seed=8), 1)  # ... layer 1 fails it: both give it back
        assert [layer.get_seq_length() for layer in cache.layers] == [5, 5]


def test_attend_refuses_keys_of_another_step():
    with TieredCache(block_tokens=4) as cache:
        cache.layers.append(TieredLayer(cache, 0))
        keys, values = kv(1, 2)
        with pytest.raises(TierKVError, match="must be called with that cache"):
            cache.layers[0].attend(keys, values, torch.zeros(1, 4, 2, 8), None, 1.0, None)


def test_a_layer_outliving_its_cache_says_so():
    cache = TieredCache(block_tokens=4)
    layer = TieredLayer(cache, 0)
    cache.close()
    del cache
    import gc

    gc.collect()
    with pytest.raises(TierKVError, match="garbage-collected"):
        layer.get_seq_length()


def test_a_layers_keys_and_values_are_what_it_holds_read_from_every_tier(tmp_path):
    """``layer.keys`` / ``values`` as DynamicCache's layers have them (transformers' Whisper, RAG and users read
    them), read from the device, host and disk tiers; a sliding layer's as DynamicSlidingWindowLayer keeps them."""
    from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=6,
                          layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 23))
    reference = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=reference)
    gpu = f"{TieredCache.min_device_bytes(config, 23, 2, block_tokens=4)}B"
    with TieredCache(gpu_gb=gpu, cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, config=config) as cache:
        assert cache.layers[0].keys is None and cache.layers[1].values is None  # nothing held yet
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache)
        assert all(cache.stats()["blocks"][tier] for tier in ("device", "host", "disk"))
        full, sliding = cache.layers[1], cache.layers[0]
        assert torch.equal(full.keys, reference.layers[1].keys) and torch.equal(full.values, reference.layers[1].values)
        assert torch.equal(sliding.keys, reference.layers[0].keys)  # the window less one
        assert torch.equal(sliding.values, reference.layers[0].values)
        with pytest.raises(InvalidConfigError, match="cannot be assigned"):
            full.keys = reference.layers[1].keys
    assert full.keys is None  # closed: nothing held
