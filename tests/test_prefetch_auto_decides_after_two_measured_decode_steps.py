"""``prefetch_depth="auto"`` decides once two decode steps were measured, at the start of the next one: not on a
step that measured the prefill (whose layers read everything at once, not what decoding reads), and not later
than the measurements it needs. When staging grows it decides again, on two decode steps at the new size."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from models import tiny_model

from tierkv import TieredCache
from tierkv.bandwidth import Link, LinkProfile

LINKS = ("host->device", "device->host", "device->device", "disk->host", "host->disk", "host->host")


@contextlib.contextmanager
def _decoded(tokens: int, new: int) -> Iterator[TieredCache]:
    """A 4-layer model's 48-token prompt and ``new`` greedy tokens through a cache at ``prefetch_depth="auto"``
    (device budget: the minimum for ``tokens`` at depth 3; links profiled as instant)."""
    model = tiny_model("llama", layers=4)
    ids = torch.randint(2, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    device = TieredCache.min_device_bytes(model.config, tokens, block_tokens=4, prefetch_depth=3)
    fast = LinkProfile({key: Link(key, 1e15, 0.0) for key in LINKS})
    with TieredCache(gpu_gb=f"{device}B", cpu_gb="1MB", block_tokens=4, prefetch_depth="auto", profile=fast) as cache:
        model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)
        yield cache


def test_the_depth_is_chosen_at_the_third_decode_step():
    """Step 0 is the prefill, steps 1 and 2 the measured decode steps: the decision is recorded at step 3, and
    the cache then reads at the depth chosen."""
    with _decoded(56, 6) as cache:
        choices = cache.stats()["prefetch_auto"]
        assert [choice["step"] for choice in choices] == [3]
        assert cache.stats()["prefetch_depth"] == choices[0]["depth"]


def test_the_depth_is_chosen_again_two_decode_steps_after_staging_grew():
    """Staging for 48 tokens grows at token 49 (step 1, to 60 tokens) and at token 61 (step 13): the decisions are
    recorded at step 3 and, two measured steps after the second growth, at step 15."""
    with _decoded(64, 16) as cache:
        assert [choice["step"] for choice in cache.stats()["prefetch_auto"]] == [3, 15]
