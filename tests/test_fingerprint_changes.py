"""What makes two models' persisted blocks interchangeable: the model fingerprint must change with any weight
byte (not only the first bytes of a tensor) and with the config entries that change the K/V (not only its
weights and buffers), since a block computed by one model is wrong K/V for the other."""

from __future__ import annotations

import copy

import torch
import transformers
from models import prompt, tiny_model

from tierkv.persist.keys import Namespace, model_fingerprint


def _kv(model: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[-1]
    return torch.stack([layer.keys, layer.values])


def test_a_change_in_the_last_element_of_a_weight_changes_the_fingerprint():
    """A fine-tune that changes one element far from a tensor's start: its K/V differ, and so must its keys."""
    model = tiny_model.__wrapped__("llama")
    other = copy.deepcopy(model)
    weight = other.model.layers[0].self_attn.k_proj.weight
    with torch.no_grad():
        weight.view(-1)[-1] += 0.5
    ids, _ = prompt(1, 12, seed=3)
    assert not torch.equal(_kv(model, ids), _kv(other, ids))  # the reason blocks must not be shared
    assert model_fingerprint(other, cached=False) != model_fingerprint(model, cached=False)
    assert Namespace.of_model(other, 4).root != Namespace.of_model(model, 4).root


def test_the_same_weights_under_a_config_that_computes_other_kv_have_another_fingerprint():
    """The same weights (and buffers) in a model built from a config that differs in rms_norm_eps compute other
    K/V: not the same namespace, so neither model loads the other's blocks."""
    model = tiny_model.__wrapped__("llama")
    config = copy.deepcopy(model.config)
    config.rms_norm_eps = 0.5
    other = type(model)(config).to(torch.float32).eval()
    other.load_state_dict(model.state_dict())
    ids, _ = prompt(1, 12, seed=4)
    assert not torch.allclose(_kv(model, ids), _kv(other, ids))  # the K/V differ
    assert model_fingerprint(other, cached=False) != model_fingerprint(model, cached=False)
    assert Namespace.of_model(other, 4).root != Namespace.of_model(model, 4).root
