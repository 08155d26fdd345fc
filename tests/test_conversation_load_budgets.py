"""Loading a saved conversation checks its header against the budgets of the cache it builds, before any K/V
record is read: K/V beyond gpu_gb + cpu_gb + disk_gb is a CapacityError, and a block column (one block of every
layer for every row, which the device holds while decoding) beyond gpu_gb a BudgetTooSmallError."""

from __future__ import annotations

import pytest
import torch
from models import prompt, tiny_model

from tierkv.errors import BudgetTooSmallError, CapacityError
from tierkv.hf import TieredCache, cache_keyword, sizing

BT = 4
BATCH = 2
PROMPT = 22


@pytest.fixture
def saved(tmp_path):
    model = tiny_model("llama", "sdpa", None)
    ids, _ = prompt(BATCH, PROMPT, seed=3)
    cache = TieredCache(block_tokens=BT, gpu_gb="4MiB", cpu_gb="4MiB")
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
    path = tmp_path / "conversation.tkv"
    cache.save(path, model=model)
    cache.close()
    return model, path


def _block_column_bytes(model) -> int:
    layouts = sizing.layer_layouts(model.config, BT, None)
    return BATCH * sum(layout.block_bytes for layout in layouts)


def _held_bytes(model) -> int:
    layouts = sizing.layer_layouts(model.config, BT, None)
    return BATCH * PROMPT * sum(layout.token_bytes for layout in layouts)


def test_kv_beyond_all_budgets_is_refused_before_loading(saved):
    model, path = saved
    held = _held_bytes(model)
    column = _block_column_bytes(model)
    layouts = sizing.layer_layouts(model.config, BT, None)
    device = (len(layouts) * BATCH + 1) * layouts[0].slot_bytes  # every row's open block of every layer, and one
    assert device >= column
    host = held - device - 1  # one byte short of the K/V, with no disk tier
    assert host > 0
    with pytest.raises(CapacityError, match=rf"holds .* of K/V \({held} bytes\), more than .*Nothing of the file"):
        TieredCache.load(path, model=model, gpu_gb=f"{device}B", cpu_gb=f"{host}B")
    loaded = TieredCache.load(path, model=model, gpu_gb=f"{device}B", cpu_gb="4MiB")
    assert loaded.get_seq_length() == PROMPT
    loaded.close()


def test_a_block_column_beyond_the_device_budget_is_refused_before_loading(saved):
    model, path = saved
    column = _block_column_bytes(model)
    with pytest.raises(BudgetTooSmallError, match=r"one block of every layer .*Nothing of the file was loaded"):
        TieredCache.load(path, model=model, gpu_gb=f"{column - 1}B", cpu_gb="4MiB")


def test_a_sliding_window_conversation_claims_only_the_tokens_its_windows_hold(tmp_path):
    """Layers with an 8-token window hold about a block of a 63-token conversation (once a decode step let the
    blocks before the window go): its file loads into budgets
    that hold that, far below what 64 tokens of every layer would take."""
    model = tiny_model("mistral", "sdpa", 8)
    bt = 16
    ids, _ = prompt(1, 64, seed=5)
    next_token = ids[:, -1:]
    with TieredCache(block_tokens=bt, gpu_gb="1MiB", cpu_gb="1MiB", config=model.config) as cache, \
            torch.inference_mode():
        model(input_ids=ids[:, :-2], use_cache=True, **{cache_keyword(model): cache})
        model(input_ids=ids[:, -2:-1], use_cache=True, **{cache_keyword(model): cache})  # a step: the window drops
        path = tmp_path / "window.tkv"
        cache.save(path, model=model)
        expected = model(input_ids=next_token, use_cache=True, **{cache_keyword(model): cache}).logits
    layouts = sizing.layer_layouts(model.config, bt, None)
    slot = layouts[0].slot_bytes
    every_token = 63 * sum(layout.token_bytes for layout in layouts)
    device, host = (len(layouts) + 1) * slot, 2 * slot
    assert device + host < every_token  # the budgets could not hold 63 tokens of every layer
    with TieredCache.load(path, model=model, gpu_gb=f"{device}B", cpu_gb=f"{host}B", config=model.config) as loaded, \
            torch.inference_mode():
        assert loaded.get_seq_length() == 63 and all(layer.dropped > 0 for layer in loaded.kv_layers)
        logits = model(input_ids=next_token, use_cache=True, **{cache_keyword(model): loaded}).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_rows_that_shared_a_prompts_blocks_are_claimed_one_by_one_and_the_refusal_says_so(tmp_path):
    """Rows repeated over one prompt share its blocks while the cache decodes, but a file holds every row's K/V
    on its own: loading claims them unshared, so budgets that held the conversation may refuse it, and the error
    says why (instead of a claim that looks wrong for the cache that saved it)."""
    model = tiny_model("llama", "sdpa", None)
    bt, rows, chunk = 16, 4, 64
    ids, _ = prompt(1, 25 * bt, seed=4)  # 25 full blocks a layer, shared by every row
    layouts = sizing.layer_layouts(model.config, bt, None)
    one_row = 25 * bt * sum(layout.token_bytes for layout in layouts)
    device = TieredCache.min_streaming_device_bytes(model.config, rows, block_tokens=bt, chunk_tokens=chunk)
    budgets = {"block_tokens": bt, "gpu_gb": f"{device}B", "cpu_gb": f"{2 * one_row}B"}
    cache = TieredCache(**budgets)
    with torch.inference_mode(), cache.streaming(model, chunk_tokens=chunk):
        model(input_ids=ids, use_cache=True, **{cache_keyword(model): cache})
        cache.batch_repeat_interleave(rows)  # the rows share the prompt's blocks
        model(input_ids=torch.full((rows, 1), 5), use_cache=True, **{cache_keyword(model): cache})
    path = tmp_path / "rows.tkv"
    cache.save(path, model=model)
    cache.close()
    with pytest.raises(CapacityError, match=rf"holds each of its {rows} rows' K/V on its own, so rows that shared "
                                            rf"blocks .* take {rows}x their tokens here"):
        TieredCache.load(path, model=model, **budgets)
    loaded = TieredCache.load(path, model=model, **{**budgets, "cpu_gb": f"{rows * 2 * one_row}B"})
    assert loaded.get_seq_length() == 25 * bt + 1 and loaded.batch_size == rows
    loaded.close()
