"""A layer that caches another number of tokens than the forward's first layer did (a cross-attention layer
keeping an image's K/V, as Mllama's) is refused in every forward: the first forward of a fresh cache, and the
forward after a step that was refused and taken back, as well as one after complete forwards. The refusal takes the
forward's step back, so the layers keep one length and the tokens accepted before it."""

from __future__ import annotations

import pytest
from helpers import STEP_CONFIG, forward_steps, kv_step

from tierkv import InvalidConfigError, TieredCache

UNEVEN = "cached 3 tokens in a forward whose first layer cached 1"


def lengths(cache: TieredCache) -> list[int]:
    return [layer.get_seq_length() for layer in cache.layers]


@pytest.mark.parametrize("config", [STEP_CONFIG, None], ids=["config", "no-config"])
def test_an_uneven_step_in_the_first_forward_is_refused(config):
    """A fresh cache's first forward: layer 1 caches three tokens where layer 0 cached one."""
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, config=config) as cache:
        cache.update(kv_step(1, 1), kv_step(1, 1), 0)
        with pytest.raises(InvalidConfigError, match=UNEVEN):
            cache.update(kv_step(3, 2), kv_step(3, 2), 1)
        assert cache.get_seq_length() == 0
        forward_steps(cache, 2, 3)  # and the cache takes a sequence afterwards
        assert lengths(cache) == [2, 2, 2]


def test_an_uneven_step_after_a_step_taken_back_is_refused():
    """The forward after a refused (and taken back) step: its uneven layer is refused too, and the cache keeps
    the tokens of the complete forwards before."""
    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", block_tokens=4, config=STEP_CONFIG) as cache:
        forward_steps(cache, 5, 1)
        cache.update(kv_step(1, 2), kv_step(1, 2), 0)
        with pytest.raises(InvalidConfigError, match=UNEVEN):
            cache.update(kv_step(3, 3), kv_step(3, 3), 1)
        assert lengths(cache) == [5, 5, 5]
        cache.update(kv_step(1, 4), kv_step(1, 4), 0)
        with pytest.raises(InvalidConfigError, match=UNEVEN):
            cache.update(kv_step(3, 5), kv_step(3, 5), 1)
        assert lengths(cache) == [5, 5, 5]
