"""K/V that tierkv reuses (the persistent prefix store, conversation files) must be what the model computes now:
a forward hook of the user's, inputs passed positionally, a config, attention implementation or training mode
changed in place, a forward that adds tokens of its own, or weights written through ``.data`` never let K/V of
another computation be served under the ids."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers import reuse_prefix, stored_blocks
from models import tiny_model
from transformers import LlamaForCausalLM

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError
from tierkv.persist.keys import model_fingerprint, user_hooks

IDS = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(21))


def options(model: torch.nn.Module, directory) -> dict:
    return {"gpu_gb": "1MB", "cpu_gb": "1MB", "disk_dir": directory, "persist": True, "block_tokens": 8,
            "config": model.config}


def store(model: torch.nn.Module, directory, forward=None) -> None:
    """A first process: ``load_prefix(model, IDS)``, then ``forward(model, cache)`` (a plain forward of the ids)."""
    with TieredCache(**options(model, directory)) as cache, torch.no_grad():
        assert cache.load_prefix(model, IDS) == 0
        if forward is None:
            model(input_ids=IDS, past_key_values=cache)
        else:
            forward(model, cache)


def reuse(model: torch.nn.Module, directory) -> int:
    """A later process: the tokens ``load_prefix`` loads, with the tail's logits equal to a ``DynamicCache`` run."""
    return reuse_prefix(model, IDS, directory)


def llama() -> torch.nn.Module:
    return copy.deepcopy(tiny_model("llama"))


def steer(module, args, output):
    return output * 3.0


def test_a_forward_hook_of_the_users_stops_persistence_and_loading(tmp_path, caplog):
    model = llama()
    handle = model.model.layers[0].mlp.register_forward_hook(steer)
    with caplog.at_level("INFO", logger="tierkv"):
        store(model, tmp_path)
    assert stored_blocks(tmp_path) == 0
    assert "test_provenance.steer" in caplog.text and "handle.remove()" in caplog.text
    handle.remove()
    store(model, tmp_path)  # without it: stored
    assert stored_blocks(tmp_path) == 5
    handle = model.register_forward_pre_hook(lambda module, args: None)  # present at load_prefix: nothing loaded
    caplog.clear()
    with TieredCache(**options(model, tmp_path)) as cache, caplog.at_level("INFO", logger="tierkv"):
        assert cache.load_prefix(model, IDS) == 0
    assert "(model): test_provenance.test_a_forward_hook_of_the_users_stops_persistence_and_loading.<locals>.<lambda>" \
        in caplog.text
    handle.remove()
    assert reuse(model, tmp_path) == 32


def test_a_pre_hook_registered_after_load_prefix_that_rewrites_ids_persists_nothing(tmp_path):
    model = llama()

    def rewrite(model, cache):
        handle = model.register_forward_pre_hook(
            lambda module, args, kwargs: (args, {**kwargs, "input_ids": (kwargs["input_ids"] + 1) % 128}),
            with_kwargs=True)
        model(input_ids=IDS, past_key_values=cache)
        handle.remove()

    store(model, tmp_path, rewrite)
    assert stored_blocks(tmp_path) == 0
    assert reuse(model, tmp_path) == 0


def test_a_global_module_hook_stops_persistence(tmp_path):
    model = llama()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        store(model, tmp_path)
    finally:
        handle.remove()
    assert stored_blocks(tmp_path) == 0


class Steering:
    def shift(self, module, args, output, scale):
        return output * scale


def test_user_hooks_are_named_and_the_librarys_are_not(tmp_path):
    model = llama()
    with TieredCache(**options(model, tmp_path)) as cache, torch.no_grad():
        cache.load_prefix(model, IDS)  # tierkv's own hooks
        model(input_ids=IDS, past_key_values=cache, output_hidden_states=True)  # transformers' output capturing
        assert user_hooks(model) == []
    model.model.layers[1].register_forward_hook(functools.partial(Steering().shift, scale=2.0))
    assert user_hooks(model) == ["model.layers.1: test_provenance.Steering.shift"]


def test_a_conversation_saved_with_a_hook_is_refused_without_it(tmp_path):
    model = llama()
    ids = IDS[:, :24]
    handle = model.model.layers[0].mlp.register_forward_hook(steer)
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=8) as cache, torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        cache.save(tmp_path / "c.tkv", model=model)
    handle.remove()
    with pytest.raises(InvalidConfigError, match="saved from another model"):
        TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB")


@pytest.mark.parametrize("call", ["positions", "mask"])
def test_positional_mask_and_positions_are_checked(tmp_path, call):
    model = llama()
    if call == "positions":
        store(model, tmp_path, lambda model, cache: model(IDS, None, torch.arange(100, 140)[None],
                                                           past_key_values=cache))
    else:
        mask = torch.ones_like(IDS)
        mask[:, :3] = 0
        store(model, tmp_path, lambda model, cache: model(IDS, mask, past_key_values=cache))
    assert stored_blocks(tmp_path) == 0
    store(model, tmp_path, lambda model, cache: model(IDS, None, torch.arange(40)[None], past_key_values=cache))
    assert stored_blocks(tmp_path) == 5  # the positions a forward takes anyway, positionally: stored


def test_a_compiled_model_called_positionally_persists_and_reuses(tmp_path):
    """``torch.compile``'s wrapper takes ``*args, **kwargs``: its inputs are bound to the compiled model's own
    forward, so positional ids are checked (and persisted) as keywords are."""
    model = torch.compile(llama(), backend="eager")
    store(model, tmp_path, lambda model, cache: model(IDS, past_key_values=cache))
    assert stored_blocks(tmp_path) == 5
    assert reuse_prefix(model, IDS, tmp_path) == 32


def edit_config(model: torch.nn.Module, cache: TieredCache) -> None:
    model.config.sliding_window = 4
    model(input_ids=IDS, past_key_values=cache)
    model.config.sliding_window = None


def switch_attention(model: torch.nn.Module, cache: TieredCache) -> None:
    model.set_attn_implementation("eager")
    model(input_ids=IDS, past_key_values=cache)
    model.set_attn_implementation("sdpa")


def train_a_layer(model: torch.nn.Module, cache: TieredCache) -> None:
    model.model.layers[0].train()
    model(input_ids=IDS, past_key_values=cache)
    model.model.layers[0].eval()


@pytest.mark.parametrize("change", [edit_config, switch_attention, train_a_layer])
def test_a_computation_changed_in_place_for_a_forward_persists_nothing(tmp_path, change):
    model = copy.deepcopy(tiny_model("mistral"))
    store(model, tmp_path, change)
    assert stored_blocks(tmp_path) == 0
    assert reuse(model, tmp_path) == 0


class Prepending(LlamaForCausalLM):
    """A Llama whose forward puts a BOS token before the ids it is given: its cache grows by one more."""

    def forward(self, input_ids=None, **kwargs):
        return super().forward(input_ids=torch.cat([torch.ones_like(input_ids[:, :1]), input_ids], 1), **kwargs)


def test_a_forward_that_adds_tokens_over_loaded_kv_is_refused(tmp_path):
    plain = llama()
    store(plain, tmp_path)
    model = Prepending(plain.config).eval()
    model.load_state_dict(plain.state_dict())
    assert model_fingerprint(model) == model_fingerprint(plain)  # nothing tells them apart before a forward
    with TieredCache(**options(model, tmp_path)) as cache, torch.no_grad():
        assert cache.load_prefix(model, IDS) == 32
        with pytest.raises(InvalidConfigError, match="added 9 tokens to the cache for its 8"):
            model(input_ids=IDS[:, 32:], past_key_values=cache)
        cache.reset()
        assert cache.load_prefix(model, IDS) == 0


def test_weights_written_through_data_are_not_taken_for_the_cached_digest(tmp_path):
    model = llama()
    store(model, tmp_path)
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=8) as cache, torch.no_grad():
        model(input_ids=IDS, past_key_values=cache)
        cache.save(tmp_path / "c.tkv", model=model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data.mul_(1.05)  # bumps no tensor version
    assert reuse(model, tmp_path) == 0
    with pytest.raises(InvalidConfigError, match="saved from another model"):
        TieredCache.load(tmp_path / "c.tkv", model=model, gpu_gb="1MB", cpu_gb="1MB")
