"""``disk_read_ahead_hits`` counts reads whose disk part a read ahead had in flight: a cache without a disk tier
reads nothing from disk, so it has none, however many reads its steps make from the host."""

from __future__ import annotations

import torch
from models import prompt, tiny_model

from tierkv import TieredCache


def test_a_cache_without_disk_counts_no_disk_read_ahead_hits():
    model = tiny_model("llama", layers=2)
    ids, _ = prompt(1, 30, seed=3)
    with TieredCache(gpu_gb="40KB", cpu_gb="1MB", block_tokens=4) as cache, torch.no_grad():
        with cache.streaming(model, chunk_tokens=8):
            logits = model(ids, past_key_values=cache).logits[:, -1]
            for _ in range(4):
                logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
        for _ in range(2):  # the default executor (exact gather)
            logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
        stats = cache.stats()
    assert stats["bytes_moved"].get("host->device", 0) > 0  # the steps did read from the host
    assert not any(nbytes for link, nbytes in stats["bytes_moved"].items() if "disk" in link)
    assert stats["blocks"]["disk"] == 0 and stats["disk_engine"] is None
    assert stats["disk_read_ahead_hits"] == 0
