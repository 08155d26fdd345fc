"""A decode step's telemetry counts one new token although a sliding layer late in the pass dropped a block (its
stored length went down): the step's new tokens are the most any layer of the pass took, so decode steps stay
decode steps — which ``prefetch_depth="auto"`` and the step statistics select on."""

from __future__ import annotations

import torch
from models import tiny_model

from tierkv import TieredCache


def test_every_step_after_the_prefill_is_a_decode_step():
    model = tiny_model("gemma2", "eager", 8, layers=3)  # layers 0 and 2 slide over 8 tokens, layer 1 is full
    ids = torch.randint(2, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    with TieredCache(gpu_gb="4MB", cpu_gb="1MB", block_tokens=4, config=model.config) as cache:
        model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache)
        steps = cache.executor.timeline.completed()
    assert [step.new_tokens for step in steps] == [20] + [1] * (len(steps) - 1)
    assert len(steps) >= 8
