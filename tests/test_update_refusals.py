"""A refused call leaves every accepted token readable: ``update`` arguments that are not a layer's step, a
layer index out of range, a repeated or uneven update, and the row, crop, save, load and trace calls given values
of the wrong kind, each refused with an error that names the argument (InvalidConfigError), and the K/V held
before it equal to what it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import STEP_CONFIG, forward_steps, kv_step
from models import small_llama
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache
from tierkv.hf import cache_keyword
from tierkv.hf.cache import MAX_LAYERS


def _held(cache: TieredCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _same(before: list[tuple[torch.Tensor, torch.Tensor]], cache: TieredCache) -> bool:
    return all(torch.equal(k, layer.keys) and torch.equal(v, layer.values)
               for (k, v), layer in zip(before, cache.layers, strict=True))


@pytest.fixture(params=["config", "no config"])
def cache(request):
    config = {"config": STEP_CONFIG} if request.param == "config" else {}
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, **config) as cache:
        forward_steps(cache, 5, 1)
        forward_steps(cache, 1, 2)
        yield cache


@pytest.mark.parametrize("layer_idx", [-1, True, None, 1.0, "0"])
def test_a_layer_index_refused_after_a_complete_forward_keeps_every_token(cache, layer_idx):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match="layer_idx must be an int"):
        cache.update(kv_step(1, 9), kv_step(1, 9), layer_idx)
    assert cache.get_seq_length() == 6 and _same(before, cache)
    assert len(cache.layers) == 3
    forward_steps(cache, 1, 3)  # and the sequence goes on
    assert cache.get_seq_length() == 7


@pytest.mark.parametrize("layer_idx", [3, 2**63])
def test_a_layer_past_every_layer_takes_back_the_forward_it_continues(cache, layer_idx):
    """Past every layer is where a model with more layers than the config's goes on: its forward is refused, and
    the layers that took its step give it back (the model whose cache it is then decodes on exactly)."""
    if layer_idx == 3 and cache.runtime.num_layers is None:  # without a config it adds a layer, as DynamicCache
        reference = DynamicCache()
        forward_steps(reference, 5, 1)
        forward_steps(reference, 1, 2)
        got, want = cache.update(kv_step(1, 9), kv_step(1, 9), 3), reference.update(kv_step(1, 9), kv_step(1, 9), 3)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert [layer.keys.shape[2] for layer in cache.layers] == [6, 6, 6, 1] == \
            [layer.keys.shape[2] for layer in reference.layers]
    else:
        with pytest.raises(InvalidConfigError, match="beyond.*gave it back: the cache holds 5 tokens"):
            cache.update(kv_step(1, 9), kv_step(1, 9), layer_idx)
        assert [layer.keys.shape[2] for layer in cache.layers] == [5, 5, 5]


def test_a_layer_index_refused_mid_forward_takes_that_forwards_step_back(cache):
    before = _held(cache)
    cache.update(kv_step(1, 5), kv_step(1, 5), 0)
    with pytest.raises(InvalidConfigError):
        cache.update(kv_step(1, 6), kv_step(1, 6), -1)
    assert cache.get_seq_length() == 6 and _same(before, cache)
    forward_steps(cache, 1, 3)
    assert [layer.keys.shape[2] for layer in cache.layers] == [7, 7, 7]


def test_a_huge_layer_index_without_a_config_is_refused_before_layers_grow():
    with TieredCache(gpu_gb="1MB", block_tokens=4) as cache:
        forward_steps(cache, 2, 1)
        forward_steps(cache, 1, 2)
        with pytest.raises(InvalidConfigError, match=f"{MAX_LAYERS:,} layers.*holds 2 tokens"):
            cache.update(kv_step(1, 3), kv_step(1, 3), MAX_LAYERS)
        assert len(cache.layers) == 3 and cache.get_seq_length() == 2


@pytest.mark.parametrize(("keys", "values", "needle"), [
    (None, None, "key_states as a torch.Tensor"),
    (kv_step(1, 0).tolist(), kv_step(1, 0), "key_states as a torch.Tensor"),
    (kv_step(1, 0).flatten(), kv_step(1, 0).flatten(), "dense tensor .* shape \\(32,\\)"),
    (kv_step(1, 0)[0], kv_step(1, 0)[0], "dense tensor"),
    (kv_step(1, 0).to_sparse(), kv_step(1, 0).to_sparse(), "sparse_coo"),
    (kv_step(1, 0), kv_step(1, 0).half(), "keys in torch.float32 and values in torch.float16"),
    (kv_step(1, 0).half(), kv_step(1, 0), "keys in torch.float16 and values in torch.float32"),
    (kv_step(1, 0).bfloat16(), kv_step(1, 0).half(), "one dtype"),
])  # fmt: skip
def test_states_that_are_not_a_layers_step_are_refused_and_change_nothing(cache, keys, values, needle):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match=needle):
        cache.update(keys, values, 0)
    assert cache.get_seq_length() == 6 and _same(before, cache)


def test_a_numpy_layer_index_is_a_layer_index(cache):
    for layer in range(3):
        cache.update(kv_step(1, layer), kv_step(1, layer), np.int64(layer))
    assert [layer.keys.shape[2] for layer in cache.layers] == [7, 7, 7]


def test_a_repeated_update_after_a_complete_forward_changes_nothing(cache):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match="updated twice in one forward.*Nothing changed"):
        cache.update(kv_step(1, 7), kv_step(1, 7), 2)
    assert cache.get_seq_length() == 6 and _same(before, cache)


def test_a_repeated_update_mid_forward_takes_that_forwards_step_back(cache):
    before = _held(cache)
    cache.update(kv_step(1, 5), kv_step(1, 5), 0)
    cache.update(kv_step(1, 6), kv_step(1, 6), 1)
    with pytest.raises(InvalidConfigError, match="updated twice in one forward.*holds 6 tokens"):
        cache.update(kv_step(1, 7), kv_step(1, 7), 1)
    assert _same(before, cache)


def test_an_uneven_update_takes_that_forwards_step_back(cache):
    before = _held(cache)
    cache.update(kv_step(1, 5), kv_step(1, 5), 0)
    with pytest.raises(InvalidConfigError, match="cached 3 tokens in a forward whose first layer cached 1.*holds 6"):
        cache.update(kv_step(3, 6), kv_step(3, 6), 1)
    assert _same(before, cache)
    forward_steps(cache, 2, 4)
    assert [layer.keys.shape[2] for layer in cache.layers] == [8, 8, 8]


@pytest.mark.parametrize("value", [None, -1.0, float("-inf"), float("nan"), "-1", True])
def test_crop_takes_an_int(cache, value):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match="crop's tokens_to_remove .* must be an int, got"):
        cache.crop(value)
    assert _same(before, cache)
    cache.crop(np.int64(-2))
    assert cache.get_seq_length() == 4


@pytest.mark.parametrize("repeats", [-1, 0, 1.5, None, True])
def test_batch_repeat_interleave_takes_a_count_of_at_least_one(cache, repeats):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match="repeats must be an int >= 1"):
        cache.batch_repeat_interleave(repeats)
    assert _same(before, cache)


@pytest.mark.parametrize("indices", [None, "0", object(), {0: 1}])
def test_rows_are_chosen_by_row_numbers(cache, indices):
    before = _held(cache)
    with pytest.raises(InvalidConfigError, match="1-D tensor of row numbers"):
        cache.batch_select_indices(indices)
    assert _same(before, cache)


@pytest.fixture(scope="module")
def model():
    return small_llama()


def test_save_and_load_take_the_model_and_a_device(model, tmp_path):
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "talk.tkv"
    with TieredCache(gpu_gb="1MB", block_tokens=4) as cache:
        with torch.no_grad():
            model(input_ids=ids, **{cache_keyword(model): cache})
        with pytest.raises(InvalidConfigError, match="save\\(\\) takes model= as the torch model itself.*LlamaConfig"):
            cache.save(path, model.config)
        assert not path.exists()
        cache.save(path, model)
    with pytest.raises(InvalidConfigError, match="load\\(\\) takes model= as the torch model itself"):
        TieredCache.load(path, model.config)
    for device in ("meta", "no-such-device", 5, f"cuda:{torch.cuda.device_count()}", torch.device("cuda", 99)):
        with pytest.raises(InvalidConfigError, match="load\\(\\) takes device="):  # (a GPU it lacks: raw errors)
            TieredCache.load(path, model, device=device, gpu_gb="1MB")
    with TieredCache.load(path, model, gpu_gb="1MB") as loaded:
        reference = DynamicCache()
        with torch.no_grad():
            model(input_ids=ids, past_key_values=reference)
        assert torch.equal(loaded.layers[0].keys, reference.layers[0].keys)


def test_save_trace_refuses_a_path_it_cannot_write(tmp_path):
    with TieredCache(gpu_gb="1MB", block_tokens=4, trace=True) as cache:
        forward_steps(cache, 2, 1)
        for path, needle in (("", "is empty"), (tmp_path / "missing" / "t.json", "not an existing directory")):
            with pytest.raises(InvalidConfigError, match=f"save_trace\\(.*{needle}"):
                cache.save_trace(path)
        cache.save_trace(tmp_path / "t.json")
        assert (tmp_path / "t.json").stat().st_size > 0


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(profile={}), "profile must be a LinkProfile or the path"),
    (dict(profile=5), "profile must be a LinkProfile or the path"),
    (dict(trace=5), "trace must be True"),
    (dict(trace=b"/tmp/t.json"), "trace must be True"),
])  # fmt: skip
def test_profile_and_trace_of_the_wrong_kind_are_refused(kwargs, needle):
    with pytest.raises(InvalidConfigError, match=needle):
        TieredCache(gpu_gb="1MB", **kwargs)
