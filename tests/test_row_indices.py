"""Row selection (beam reorder, batch selection) refuses a row number one past the batch, as DynamicCache does,
instead of wrapping it onto row 0 (which would hand that row another row's K/V), and changes nothing."""

from __future__ import annotations

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache


@pytest.mark.parametrize("method", ["batch_select_indices", "reorder_cache"])
@pytest.mark.parametrize("index", [[2], [0, 2], [-3]])
def test_a_row_past_the_batch_is_refused_as_dynamic_cache_refuses_it(method, index):
    model = tiny_model("llama")
    ids, _ = prompt(2, 9, seed=5)
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=reference)
    with pytest.raises((IndexError, RuntimeError)):
        getattr(reference, method)(torch.tensor(index))
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4) as cache:
        with torch.no_grad():
            model(ids, past_key_values=cache)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        with pytest.raises(IndexError, match="out of range"):
            getattr(cache, method)(torch.tensor(index))
        assert cache.get_seq_length() == 9
        for (keys, values), layer in zip(before, cache.layers, strict=True):
            assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)
