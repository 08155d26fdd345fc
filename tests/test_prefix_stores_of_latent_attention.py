"""Multi-head latent attention (DeepSeek V2 / V3, MiniCPM3) caches one head of its latent and rotary key, not the
config's K/V heads: a prefix store's namespace takes the shape the cache stores (the config's would match no
stored layer, and no sequence would be persisted), so a prefix stored by one cache is loaded by the next and
decodes exactly."""

from __future__ import annotations

import pytest
import torch
from models import prompt
from test_hf_architectures import MLA, MLA_MOE, build
from transformers import DynamicCache

from tierkv import TieredCache


@pytest.mark.parametrize(("family", "extra"), [("DeepseekV3", MLA_MOE), ("MiniCPM3", {})])
def test_a_latent_attention_prefix_is_stored_and_loaded_exactly(tmp_path, family, extra):
    model = build(f"{family}Config", f"{family}ForCausalLM", **MLA, **extra)
    ids, mask = prompt(1, 30, seed=2)
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                   return_dict_in_generate=True)
    reference = model.generate(ids, past_key_values=DynamicCache(config=model.config), **options)
    budgets = dict(gpu_gb="1MB", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4, persist=True, config=model.config)
    with TieredCache(**budgets) as cache:
        assert cache.load_prefix(model, ids) == 0
        model.generate(ids, past_key_values=cache, **options)
        cache.flush()
        assert cache.session.namespace.kv_heads == 1  # the stored latent head, not the config's 4 K/V heads
    with TieredCache(**budgets) as cache:
        assert cache.load_prefix(model, ids) == 28
        out = model.generate(ids, past_key_values=cache, **options)
    assert torch.equal(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(reference.logits), atol=1e-4, rtol=0)
