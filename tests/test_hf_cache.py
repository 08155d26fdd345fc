"""tierkv.hf.cache: the cache stays consistent after any refusal, executor modes keep their device promises, and a
streaming()/sparse() that is never entered is refused — each against DynamicCache on a real model."""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
from models import VOCAB, prompt, tiny_model
from transformers import DynamicCache

from tierkv import BudgetTooSmallError, InvalidConfigError, TieredCache
from tierkv.units import parse_size


def test_a_layer_beyond_the_config_rolls_the_forward_back():
    """A 12-layer model on a cache built for 8 layers is refused at layer 8; layers 0-7 give the step back, so
    the 8-layer model's next step equals DynamicCache's."""
    small, large = tiny_model("llama", layers=8), tiny_model("llama", layers=12)
    ids, _ = prompt(1, 20, seed=5)
    reference = DynamicCache()
    with TieredCache(block_tokens=4, config=small.config) as cache:
        torch.testing.assert_close(small(ids, past_key_values=cache).logits,
                                   small(ids, past_key_values=reference).logits, atol=1e-5, rtol=0)
        token = ids[:, -1:]
        with pytest.raises(InvalidConfigError, match="beyond the 8 layers"):
            large(token, past_key_values=cache)
        assert {layer.get_seq_length() for layer in cache.layers} == {20}
        got = small(token, past_key_values=cache).logits
        expected = small(token, past_key_values=reference).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_streaming_entered_after_an_exact_prefill_needs_no_more_than_promised():
    """Prefill with exact gather (its staging holds whole layers), then stream at min_streaming_device_bytes
    plus a little room for the blocks: entering streaming releases exact gather's staging."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 24, seed=2)
    reference, steps = DynamicCache(), []
    model(ids, past_key_values=reference)
    token = ids[:, -1:]
    for _ in range(3):
        steps.append((token, model(token, past_key_values=reference).logits))
        token = steps[-1][1][:, -1].argmax(-1, keepdim=True)
    gpu = TieredCache.min_streaming_device_bytes(model.config, block_tokens=4, chunk_tokens=8, device="cpu")
    with TieredCache(gpu_gb=f"{gpu + 16 * 1024}B", cpu_gb="64MB", block_tokens=4, config=model.config) as cache:
        model(ids, past_key_values=cache)
        assert cache.executor.staging.reserved > 0
        with cache.streaming(model, chunk_tokens=8):
            assert cache.executor.staging.reserved == 0  # released on entry
            for token, expected in steps:
                torch.testing.assert_close(model(token, past_key_values=cache).logits, expected, atol=1e-5, rtol=0)
        assert cache.executors["streaming"].staging.reserved == 0  # and streaming's on exit


def test_a_budget_named_by_a_staging_error_works():
    model = tiny_model("llama")
    ids, _ = prompt(1, 64, seed=3)
    small = TieredCache.min_device_bytes(model.config, 64, block_tokens=4, device="cpu") // 4
    with TieredCache(gpu_gb=f"{small}B", block_tokens=4) as cache, pytest.raises(BudgetTooSmallError) as info:
        model(ids, past_key_values=cache)
    named = re.search(r"takes ([0-9.]+ ?[kKMG]i?B)", str(info.value))
    assert named is not None, str(info.value)
    with TieredCache(gpu_gb=named.group(1).replace(" ", ""), block_tokens=4) as cache:
        torch.testing.assert_close(model(ids, past_key_values=cache).logits,
                                   model(ids, past_key_values=DynamicCache()).logits, atol=1e-5, rtol=0)
    assert parse_size(named.group(1).replace(" ", "")) > small


@pytest.mark.parametrize("how", ["streaming", "sparse"])
def test_a_mode_that_is_never_entered_is_refused_at_the_next_forward(how):
    model = tiny_model("llama")
    ids, _ = prompt(1, 8, seed=1)
    with TieredCache(block_tokens=4) as cache:
        getattr(cache, how)(model)  # a plain statement: the mode would silently not apply
        with pytest.raises(InvalidConfigError, match=f"cache.{how}\\(model\\) was called but never entered"):
            model(ids, past_key_values=cache)
        assert cache.get_seq_length() == 0  # refused before any layer took the step
        torch.testing.assert_close(model(ids, past_key_values=cache).logits,  # reported once: then it runs
                                   model(ids, past_key_values=DynamicCache()).logits, atol=1e-5, rtol=0)


def test_a_mode_dropped_without_being_entered_warns():
    model = tiny_model("llama")
    cache = TieredCache(block_tokens=4)
    with pytest.warns(RuntimeWarning, match="never entered"):
        cache.streaming(model)
        cache.unentered = None  # the cache no longer holds it: it is collected now
        gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with cache.streaming(model):  # entered: no warning, and nothing is refused
            model(prompt(1, 4)[0], past_key_values=cache)
    cache.close()


def test_a_budget_named_when_streaming_does_not_fit_works():
    """A budget too small for the open blocks is refused with a budget to use, counted for every layer (the
    store alone knows only the layers it has seen), and that budget runs the whole scenario."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 24, seed=6)
    promised = TieredCache.min_streaming_device_bytes(model.config, block_tokens=4, chunk_tokens=8, device="cpu")

    def stream(gpu: str) -> torch.Tensor:
        with TieredCache(gpu_gb=gpu, cpu_gb="64MB", block_tokens=4, config=model.config) as cache:
            model(ids[:, :4], past_key_values=cache)  # exact gather first: its staging must not count after
            with cache.streaming(model, chunk_tokens=8):
                return model(ids[:, 4:], past_key_values=cache).logits

    with pytest.raises(BudgetTooSmallError) as info:
        stream(f"{promised // 3}B")  # refused at the first step: the store has seen one layer's open block
    named = re.search(r'gpu_gb="([0-9]+B)" holds the staging and every layer', str(info.value))
    assert named is not None, str(info.value)
    expected = model(ids, past_key_values=DynamicCache()).logits[:, 4:]
    torch.testing.assert_close(stream(named.group(1)), expected, atol=1e-5, rtol=0)


def test_a_model_that_copies_the_caches_layers_is_refused_before_any_wrong_token(tmp_path):
    """Looped models (Dory's per-loop recurrent caches) deep-copy cache layers to give each loop its own K/V: a
    copied TieredCache layer would read and write the original's blocks (wrong tokens, silently). Refused with the
    fix; nothing of the cache changed."""
    import copy
    import pickle

    from tierkv.errors import UnsupportedLayerError

    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4,
                     config=tiny_model("llama").config) as cache:
        for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(UnsupportedLayerError, match=r"layer cannot be copied.*Use transformers' DynamicCache"):
                attempt(cache.layers[1])
    transformers = pytest.importorskip("transformers")
    if "dory" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        return  # (a transformers release before the looped models)
    config = transformers.AutoConfig.for_model(
        "dory", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, n_input_layers=1, n_recurrent_layers=2, n_output_layers=1,
        n_recurrent_loops=2, recurrent_kv_cache_mode="per_loop", pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids, _ = prompt(1, 20)
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=config) as cache:
        with pytest.raises(UnsupportedLayerError, match="Dory"), torch.no_grad():
            model(input_ids=ids, cache=cache)
        assert cache.get_seq_length() == 0 and len(cache.layers) == config.num_hidden_layers


def test_a_copy_is_refused_with_the_tiered_way_to_reuse_a_prompt(tmp_path):
    """transformers' prompt-reuse recipe deep-copies the prompt's cache per continuation; a TieredCache says what
    to do instead (crop back to the prompt), and that gives the recipe's outputs."""
    import copy
    import pickle

    model = tiny_model("llama")
    shared, _ = prompt(1, 30, seed=1)
    continuations = [torch.tensor([[7, 8, 9]]), torch.tensor([[40, 41]])]
    prompt_cache = DynamicCache()
    with torch.no_grad():
        model(shared, past_key_values=prompt_cache)
    expected = [model.generate(torch.cat([shared, more], 1), past_key_values=copy.deepcopy(prompt_cache),
                               max_new_tokens=5, do_sample=False) for more in continuations]  # fmt: skip
    with TieredCache(gpu_gb="1MB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache:
        with torch.no_grad():
            model(shared, past_key_values=cache)
        for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(InvalidConfigError, match=r"cannot be copied.*cache\.crop\(prompt_tokens - "):
                attempt(cache)
        for more, want in zip(continuations, expected, strict=True):
            got = model.generate(torch.cat([shared, more], 1), past_key_values=cache, max_new_tokens=5,
                                 do_sample=False)  # fmt: skip
            assert torch.equal(got, want)
            cache.crop(shared.shape[1] - cache.get_seq_length())
            assert cache.get_seq_length() == shared.shape[1]
