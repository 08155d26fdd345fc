"""A prefix store (``persist=``, ``remote=``) keeps a block of every layer in one K/V shape, so a model whose layers
cache K/V of several shapes (Gemma 4: its full-attention layers' heads are twice as wide as its sliding ones') is
refused with the fix: when the cache is built with its config, before anything is made; without the config, at
``load_prefix``, which then changes nothing (its transformers config refuses the global ``head_dim`` a homogeneous
model's namespace is read from). Decoding without a prefix store stays exact."""

from __future__ import annotations

import pytest
import torch
from models import prompt
from test_hf_architectures import architecture
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.errors import InvalidConfigError

MIXED = "cache K/V of 2 shapes .*2 x 16, 2 x 32.*without persist= / remote="


def test_a_cache_built_with_the_config_is_refused(tmp_path):
    model = architecture("gemma4_text")
    with pytest.raises(InvalidConfigError, match=MIXED):
        TieredCache(gpu_gb="1MB", disk_dir=tmp_path, persist=True, config=model.config)


def test_load_prefix_without_the_config_is_refused_and_the_cache_decodes_exactly(tmp_path):
    model = architecture("gemma4_text")
    ids, mask = prompt(1, 24, seed=1)
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **options)
    with TieredCache(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, persist=True) as cache:
        with pytest.raises(InvalidConfigError, match=MIXED):
            cache.load_prefix(model, ids)
        assert cache.get_seq_length() == 0
        out = model.generate(ids, past_key_values=cache, **options)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), atol=1e-4, rtol=0)


def test_layers_of_one_shape_in_a_heterogeneous_config_keep_their_prefix_store(tmp_path):
    """Gemma 4 with full-attention heads as wide as its sliding ones: one shape, so the prefix store works."""
    model = architecture("gemma4_text", global_head_dim=16)
    ids, mask = prompt(1, 24, seed=1)
    options = dict(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, persist=True, config=model.config)
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 0
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, past_key_values=cache)
        cache.flush()
    with TieredCache(**options) as cache:
        assert cache.load_prefix(model, ids) == 20
