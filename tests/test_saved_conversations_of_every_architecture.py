"""A conversation saved and loaded continues exactly on every architecture of ``test_hf_architectures.py``.

Loading reads each layer's key and value head dims back from the model's config; a heterogeneous config
(transformers' ``per_layer_config``: Gemma 4's full-attention layers have wider heads than its sliding ones)
refuses the global ``head_dim``, so each layer's own config has to be read, as the cache's sizing does.
"""

from __future__ import annotations

import pytest
import torch
from models import prompt
from test_hf_architectures import ARCHITECTURES, architecture
from transformers import DynamicCache

from tierkv import TieredCache

FIRST, THEN = 2, 3


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_a_loaded_conversation_continues_as_one_that_never_left_memory(tmp_path, model_type):
    model = architecture(model_type)
    ids, mask = prompt(1, 12, seed=4)
    options = dict(max_new_tokens=FIRST + THEN, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), **options)
    budgets = dict(gpu_gb="1MB", cpu_gb="4KB", disk_dir=tmp_path, block_tokens=4)
    with TieredCache(config=model.config, **budgets) as cache:
        first = model.generate(ids, attention_mask=mask, past_key_values=cache, **{**options, "max_new_tokens": FIRST})
        cache.save(tmp_path / "turn.tkv", model=model)
    with TieredCache.load(tmp_path / "turn.tkv", model=model, **budgets) as cache:
        sequence = first.sequences  # every token attended (a generated pad id too, as in the reference)
        then = model.generate(sequence, attention_mask=torch.ones_like(sequence), past_key_values=cache,
                              **{**options, "max_new_tokens": THEN})
    assert torch.equal(then.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(then.logits), torch.stack(reference.logits[FIRST:]), atol=1e-4, rtol=0)
