"""A cache's first forward that stopped after two of its three layers (no tierkv code ran between them, as with a
Ctrl-C in the model's own code) left those two holding the prompt and the third empty. The config says a forward
updates three layers, so the next forward takes the two back and refuses itself: every layer is empty again and
the retry stores the prompt in all three. One layer reached alone may be an encoder-decoder's cross-attention
updating layer 0 again; two cannot be, so they are not let through as such."""

from __future__ import annotations

import pytest
from helpers import STEP_CONFIG, kv_step

from tierkv import TieredCache
from tierkv.errors import InterruptedStepError


def test_a_first_forward_stopped_after_two_layers_is_taken_back():
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, config=STEP_CONFIG) as cache:
        for layer in range(2):
            cache.update(kv_step(5, layer), kv_step(5, layer), layer)
        with pytest.raises(InterruptedStepError, match="rolled back to 0 tokens"):
            cache.update(kv_step(5, 0), kv_step(5, 0), 0)
        assert [layer.get_seq_length() for layer in cache.layers] == [0, 0, 0]
        for layer in range(3):
            cache.update(kv_step(5, layer), kv_step(5, layer), layer)
        assert [layer.get_seq_length() for layer in cache.layers] == [5, 5, 5]
