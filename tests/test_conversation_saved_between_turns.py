"""A conversation saved after the next turn's ``load_prefix`` (its ids given, its forward not run yet) holds the
tokens the cache holds, and loads and continues like a cache that never went to a file."""

from __future__ import annotations

import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.hf import cache_keyword

BT = 4


def test_a_save_between_load_prefix_and_its_forward_loads_and_continues(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, 26, seed=11)
    first, turn = ids[:, :14], ids
    options = dict(block_tokens=BT, disk_dir=tmp_path / "d", persist=True)
    path = tmp_path / "c.tkv"
    with TieredCache(**options) as cache, torch.inference_mode():
        cache.load_prefix(model, first)
        model(first, **{cache_keyword(model): cache})
        assert cache.load_prefix(model, turn) == first.shape[1]  # the next turn's ids, not computed yet
        cache.save(path, model=model)
    reference = DynamicCache()
    with torch.inference_mode():
        model(first, past_key_values=reference)
        expected = model(turn[:, first.shape[1]:], past_key_values=reference).logits
    with TieredCache.load(path, model=model, **options) as loaded, torch.inference_mode():
        assert loaded.get_seq_length() == first.shape[1]
        logits = model(turn[:, first.shape[1]:], **{cache_keyword(model): loaded}).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
