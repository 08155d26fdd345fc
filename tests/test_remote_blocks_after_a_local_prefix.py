"""A chain whose first blocks are on the local disk and whose next ones only on the shared server loads whole:
the remote blocks are checked at their own depth in the chain (after the local ones), so they are neither refused
nor deleted from the server as corrupt, and decoding on them matches a cache that computed everything."""

from __future__ import annotations

import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.hf import cache_keyword

BT = 4


def _cache(directory, **options) -> TieredCache:
    return TieredCache(gpu_gb="64MiB", cpu_gb="64MiB", block_tokens=BT, disk_dir=directory, persist=True, **options)


def _prompt_pass(model, cache, ids) -> None:
    cache.load_prefix(model, ids)
    with torch.inference_mode():
        model(ids, **{cache_keyword(model): cache})
    cache.flush()


def test_remote_blocks_after_local_ones_load_at_their_depth(tmp_path, redis_server):
    model = tiny_model("llama")
    ids, _ = prompt(1, 6 * BT + 1, seed=21)
    short = ids[:, : 2 * BT + 1]
    with _cache(tmp_path / "local") as local:  # this machine's disk: the chain's first two blocks
        _prompt_pass(model, local, short)
    with _cache(tmp_path / "other", remote=redis_server.url) as other:  # another worker: the whole chain remotely
        _prompt_pass(model, other, ids)
    with _cache(tmp_path / "local", remote=redis_server.url) as cache:
        assert cache.load_prefix(model, ids) == 6 * BT
        stats = cache.stats()["remote"]
        assert stats["corrupt"] == 0
        with torch.inference_mode():
            logits = model(ids[:, 6 * BT:], **{cache_keyword(model): cache}).logits
    reference = DynamicCache()
    with torch.inference_mode():
        expected = model(ids, past_key_values=reference).logits[:, 6 * BT:]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
