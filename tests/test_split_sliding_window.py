"""Split attention on a sliding-window model whose cache knows its config: the window's start moves inside the
first block it reads step after step (the key positions shift), and decoding still equals DynamicCache."""

from __future__ import annotations

import pytest
from helpers import assert_same_generation, use_host_kernel
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache

NEW = 8


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    return use_host_kernel(request.param, monkeypatch)


def _run(model, ids, mask, cache):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache, prefill_chunk_size=16)


@pytest.mark.parametrize("left_pad", [(0, 0), (0, 6)], ids=["unpadded", "left-padded"])
def test_split_with_a_config_moves_the_window_inside_its_first_block_exactly(tmp_path, kernel, left_pad):
    model = tiny_model("mistral", "sdpa", 8)
    ids, mask = prompt(2, 41, seed=3, left_pad=left_pad)
    reference = _run(model, ids, mask, DynamicCache())
    device = TieredCache.min_split_device_bytes(model.config, 2, block_tokens=4, chunk_tokens=8) + 16384
    with TieredCache(gpu_gb=f"{device}B", cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache, cache.split(model, chunk_tokens=8):
        out = _run(model, ids, mask, cache)
    assert_same_generation(out, reference, atol=1e-4)


def test_split_with_a_config_moves_the_window_inside_blocks_read_from_disk_exactly(tmp_path, kernel):
    """The same with a longer window whose blocks lie mostly on disk: the disk's rounds are attended at the
    shifted positions too."""
    model = tiny_model("mistral", "sdpa", 24)
    ids, mask = prompt(2, 41, seed=4, left_pad=(0, 6))
    reference = _run(model, ids, mask, DynamicCache())
    device = TieredCache.min_split_device_bytes(model.config, 2, block_tokens=4, chunk_tokens=8)
    with TieredCache(gpu_gb=f"{device}B", cpu_gb="8KB", disk_dir=tmp_path, block_tokens=4,
                     config=model.config) as cache, cache.split(model, chunk_tokens=8):
        out = _run(model, ids, mask, cache)
        assert cache.stats()["blocks"]["disk"] > cache.stats()["blocks"]["host"]
    assert_same_generation(out, reference, atol=1e-4)
