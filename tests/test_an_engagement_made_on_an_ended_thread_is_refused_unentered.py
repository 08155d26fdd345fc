"""``cache.streaming(model)`` made on a request thread that ended without entering it: no thread can enter it any
more, so the cache's next forward, on any thread, is refused as an engagement never entered (the caller asked for
streaming attention and would otherwise get exact gather without a word); reported once, the forward after runs."""

from __future__ import annotations

import threading

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import InvalidConfigError, TieredCache


def test_an_engagement_made_on_a_thread_that_ended_is_refused_at_the_next_forward():
    model = tiny_model("llama")
    ids, _ = prompt(1, 8, seed=1)
    with TieredCache(block_tokens=4) as cache:
        made = []
        worker = threading.Thread(target=lambda: made.append(cache.streaming(model)))
        worker.start()
        worker.join(60)
        assert made and not worker.is_alive()
        with pytest.raises(InvalidConfigError, match=r"cache.streaming\(model\) was called but never entered"):
            model(ids, past_key_values=cache)
        assert cache.get_seq_length() == 0
        torch.testing.assert_close(model(ids, past_key_values=cache).logits,
                                   model(ids, past_key_values=DynamicCache()).logits, atol=1e-5, rtol=0)
