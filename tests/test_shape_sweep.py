"""Regressions found by sweeping shapes and sizes no other test names (head widths, GQA groups, block sizes,
budgets at and below their minimums, sparse attention's budgets).

- Inside ``cache.sparse(model)`` a device budget too small was refused in streaming's terms: the error named
  ``min_streaming_device_bytes`` and its number, and "shorter chunks fit this budget", which sparse decoding
  (its selection and key summaries besides the chunks) does not fit: following the fix it gave was refused again.
  It now names ``min_sparse_device_bytes``'s number, which decodes, and shorter chunks only with what they need.
- A minimum of a gigabyte or more was said as a bare number ("which takes 3.91;"): it now carries its unit.
"""

from __future__ import annotations

import re

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import BudgetTooSmallError, InvalidConfigError, TieredCache
from tierkv.units import parse_size

BLOCK = 4
CHUNK = 8


def _named_budgets(message: str) -> list[int]:
    return [int(n) for n in re.findall(r'gpu_gb="([0-9]+)B"', message)]


def test_sparse_budget_error_names_the_sparse_minimum_and_it_decodes():
    """At the streaming minimum (what the error used to name), a sparse step is refused with
    ``min_sparse_device_bytes`` for its context; at the budget it names the prefill and the decode steps match
    DynamicCache; the shorter chunks it offers come with their own sparse minimum, not "fits this budget"."""
    model = tiny_model("llama")
    ids, mask = prompt(2, 21, seed=1, left_pad=(0, 5))
    streaming = TieredCache.min_streaming_device_bytes(model.config, 2, block_tokens=BLOCK, chunk_tokens=CHUNK)

    def decode(gpu: int) -> list[torch.Tensor]:
        with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="64MB", block_tokens=BLOCK, config=model.config) as cache, \
                cache.sparse(model, tokens=1.0, chunk_tokens=CHUNK):  # fmt: skip
            return run(model, ids, mask, cache)

    with pytest.raises(BudgetTooSmallError) as info:
        decode(streaming)
    message = str(info.value)
    assert "min_sparse_device_bytes" in message and "min_streaming_device_bytes" not in message, message
    assert "fits this budget" not in message, message
    context = int(re.search(r"over 2 layers at ([0-9]+) tokens", message).group(1))  # the step refused
    need = TieredCache.min_sparse_device_bytes(model.config, context, 1.0, 2, block_tokens=BLOCK, chunk_tokens=CHUNK)
    shorter = TieredCache.min_sparse_device_bytes(model.config, context, 1.0, 2, block_tokens=BLOCK,
                                                  chunk_tokens=CHUNK // 2)  # fmt: skip
    assert _named_budgets(message) == [need, shorter], message
    assert streaming < need
    expected = run(model, ids, mask, DynamicCache(config=model.config))
    for got, want in zip(decode(need), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def run(model, ids, mask, cache) -> list[torch.Tensor]:
    """The prompt's last logits and three greedy decode steps' (no generate: each step's logits)."""
    logits = []
    with torch.no_grad():
        step = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits[:, -1]
        for _ in range(3):
            logits.append(step)
            token = step.argmax(-1, keepdim=True)
            mask = torch.cat((mask, torch.ones_like(token)), dim=1)
            step = model(input_ids=token, attention_mask=mask, past_key_values=cache).logits[:, -1]
    return logits


def test_a_minimum_of_gigabytes_is_said_with_its_unit():
    """Million-token blocks make a 21-token prompt's staging gigabytes: the minimum is said in the size grammar
    (``3.91GB``, not ``3.91``), and reads back as at least the bytes it names."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 21, seed=1)
    with TieredCache(gpu_gb="64MB", cpu_gb="64MB", block_tokens=1 << 20, config=model.config) as cache, \
            pytest.raises(BudgetTooSmallError) as info:  # fmt: skip
        model(input_ids=ids, past_key_values=cache)
    message = str(info.value)
    need = _named_budgets(message)[0]
    assert need >= 10**9, message
    takes = re.search(r"which takes ([^;]+);", message)
    assert takes is not None and takes.group(1).endswith("GB") and parse_size(takes.group(1)) >= need, message


def test_sparse_with_past_recording_names_the_minimum_that_decodes():
    """Regression: after ``activate_past_recording()`` a sliding layer keeps its whole past, which sparse
    summarises like a full layer's; above ``min_sparse_device_bytes`` (sized for the window) a step was refused
    with the store's "raise gpu_gb to at least X", an X that moved with the budget (following it was refused
    again). The refusal now names ``min_sparse_device_bytes(..., record_past=True)``, which decodes."""
    model = tiny_model("mistral", sliding_window=8, layers=8)
    ids, mask = prompt(1, 120, seed=2)
    total = ids.shape[1] + 3
    window = TieredCache.min_sparse_device_bytes(model.config, total, 1.0, 1, block_tokens=BLOCK, chunk_tokens=CHUNK)
    whole = TieredCache.min_sparse_device_bytes(model.config, total, 1.0, 1, block_tokens=BLOCK, chunk_tokens=CHUNK,
                                                record_past=True)  # fmt: skip
    assert whole > window

    def decode(gpu: int) -> list[torch.Tensor]:
        with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="64MB", block_tokens=BLOCK, config=model.config) as cache, \
                cache.sparse(model, tokens=1.0, chunk_tokens=CHUNK):  # fmt: skip
            cache.activate_past_recording()
            return run(model, ids, mask, cache)

    with pytest.raises(BudgetTooSmallError) as info:
        decode(window)
    message = str(info.value)
    assert "record_past=True" in message and window < _named_budgets(message)[0] <= whole, message
    reference = DynamicCache(config=model.config)
    reference.activate_past_recording()
    for got, want in zip(decode(whole), run(model, ids, mask, reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_crop_refused_after_a_stopped_forward_says_what_was_taken_back():
    """A crop refused after a forward that stopped part-way counted from the rolled-back length ("cannot crop 47
    tokens" for crop(-64)), naming neither the request nor the rollback: it names both now."""
    model = tiny_model("mistral", sliding_window=4, layers=3)
    ids, mask = prompt(1, 60, seed=3)
    more, _ = prompt(1, 17, seed=4)

    def stop(*_):
        raise RuntimeError("stopped")

    with TieredCache(gpu_gb="64MB", cpu_gb="64MB", block_tokens=BLOCK, config=model.config) as cache, \
            torch.no_grad():  # fmt: skip
        model(input_ids=ids, past_key_values=cache)
        handle = model.model.layers[1].register_forward_pre_hook(stop)
        with pytest.raises(RuntimeError, match="stopped"):
            model(input_ids=more, past_key_values=cache)
        handle.remove()
        with pytest.raises(InvalidConfigError) as info:
            cache.crop(-40)
        message = str(info.value)
        assert message.startswith("crop(-40): the previous forward had stopped part-way") and \
            "the cache holds 60 now, 23 more to crop" in message and "cannot crop 23 tokens" in message, message
