"""Exact-gather staging stays as wide as the widest layer seen when a narrower layer makes it grow.

Gemma 4's full-attention layers hold heads twice as wide as its sliding ones. With a window longer than the context
the sliding layer 0 holds as many tokens as the full layer 1, so it is layer 0 that outgrows the staging at each
growth step — and the prefetch of layer 1 that follows needs the full layer's width. Decoding is exact against
DynamicCache.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from models import BOS, PAD, VOCAB, prompt
from transformers import DynamicCache

from tierkv import TieredCache

NEW = 12


def _gemma4() -> transformers.PreTrainedModel:
    try:
        config = transformers.AutoConfig.for_model(
            "gemma4_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None, tie_word_embeddings=False, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, sliding_window=256, layer_types=["sliding_attention", "full_attention"])
    except (KeyError, ValueError):
        pytest.skip("this transformers release has no gemma4_text")
    torch.manual_seed(99)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def test_a_narrow_layer_growing_staging_keeps_room_for_the_wide_one():
    model = _gemma4()
    ids, mask = prompt(1, 30, seed=4)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **kwargs)
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, config=model.config) as cache:
        out = model.generate(ids, past_key_values=cache, **kwargs)
        assert cache.executor.prefetch_hits > 0
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(out.logits, reference.logits):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
