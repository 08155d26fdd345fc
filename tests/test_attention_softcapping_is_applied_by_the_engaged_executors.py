"""Gemma 2 caps its attention scores (``softcap * tanh(score / softcap)``) before the softmax. The tiny models
elsewhere have scores far below the default cap of 50, where the cap changes nothing measurable; here the cap is 1
and the queries are scaled up so that scores reach several units, so the executors of an engaged cache must apply
the model's cap for the prompt's and a decode step's logits to equal DynamicCache's (eager attention)."""

from __future__ import annotations

import pytest
import torch
import transformers
from models import COMMON, prompt
from transformers import DynamicCache

from tierkv import TieredCache


@pytest.fixture(scope="module")
def capped():
    config = transformers.Gemma2Config(**{**COMMON, "query_pre_attn_scalar": 16, "sliding_window": 4096,
                                          "attn_logit_softcapping": 1.0})
    torch.manual_seed(7)
    model = transformers.Gemma2ForCausalLM(config).float().eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(30)  # scores of several units: the cap of 1 bends them
    return model


def logits(model, cache) -> list[torch.Tensor]:
    ids, _ = prompt(1, 12, seed=3)
    with torch.no_grad():
        return [model(ids, past_key_values=cache, use_cache=True).logits,
                model(torch.tensor([[5]]), past_key_values=cache, use_cache=True).logits]


@pytest.mark.parametrize("executor", ["streaming", "split"])
def test_softcapped_scores_give_dynamic_caches_logits(capped, executor):
    expected = logits(capped, DynamicCache(config=capped.config))
    with TieredCache(block_tokens=4, config=capped.config) as cache, \
            getattr(cache, executor)(capped, chunk_tokens=8):  # fmt: skip
        got = logits(capped, cache)
    for each, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(each, reference, atol=1e-4, rtol=0)
