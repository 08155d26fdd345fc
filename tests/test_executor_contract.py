"""The contract every registered executor keeps, driven through TieredCache on a real model class: exact
against DynamicCache across tiers and table edits, and the bookkeeping the adapter relies on."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache
from tierkv.attention.base import EXECUTORS
from tierkv.errors import TierKVError


def engage(name: str, cache: TieredCache, model):
    """How a user selects each executor (a new executor adds itself here, or the test below fails)."""
    return {"exact_gather": contextlib.nullcontext, "streaming": lambda: cache.streaming(model, chunk_tokens=8),
            "sparse": lambda: cache.sparse(model, tokens=1.0, chunk_tokens=8),
            "split": lambda: cache.split(model, chunk_tokens=8)}[name]()


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_exact_across_tiers_and_edits(tmp_path, name):
    model = tiny_model("llama")
    ids, _ = prompt(1, 24, seed=3)
    reference = DynamicCache()
    gpu = TieredCache.min_device_bytes(model.config, 40, block_tokens=4, device="cpu")  # the rest spills down
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        def run(tokens: torch.Tensor) -> torch.Tensor:
            expected = model(tokens, past_key_values=reference).logits[:, -1]
            with engage(name, cache, model):
                got = model(tokens, past_key_values=cache).logits[:, -1]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            return expected.argmax(-1, keepdim=True)

        token = run(ids)
        for step in range(8):
            if step == 4:  # a table edit mid-sequence: everything staged or read ahead is stale
                reference.crop(-3)
                cache.crop(-3)
            token = run(token)
        stats = cache.stats()
        read_down = "disk->host" if name == "split" else "disk->device"  # split attends disk blocks in host memory
        assert stats["blocks"]["disk"] > 0 and stats["bytes_moved"][read_down] > 0
        executor = cache.executors[name]
        # sparse reads what this layer's query selects, split attends in place: nothing to prefetch (prefill streams)
        assert executor.name == name and (executor.prefetch_hits > 0 or name in ("sparse", "split"))
        for method in ("invalidate", "wait_all", "pause_telemetry", "reset"):
            getattr(executor, method)()  # safe at any time, in any order
        executor.drop(0)


def test_every_executor_is_registered_by_its_name():
    assert {"exact_gather", "streaming", "sparse"} <= set(EXECUTORS)
    assert all(cls.name == name for name, cls in EXECUTORS.items())


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_padding_queries_get_what_the_models_attention_gives_them(tmp_path, name, attn):
    """A query whose every key is masked (the padding of a left-padded row; a row that is all padding) gets what
    the model's own implementation gives it — eager's softmax of equal logits: the mean of the keys; sdpa: zeros —
    at every position of every layer, although an executor attends it in pieces merged by log-sum-exp."""
    model = tiny_model("llama", attn, layers=3)
    ids, _ = prompt(3, 30, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :11] = 0
    mask[2] = 0  # all padding
    expected = model(ids, attention_mask=mask, past_key_values=DynamicCache()).logits
    gpu = TieredCache.min_device_bytes(model.config, 40, batch=3, block_tokens=4, device="cpu")
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with engage(name, cache, model):
            got = model(ids, attention_mask=mask, past_key_values=cache).logits
        assert cache.stats()["blocks"]["disk"] > 0
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_a_backward_through_the_cache_is_refused_with_the_fix(tmp_path, name):
    """Gradients through a TieredCache's attention: exact gather's missed the K/V projections (the tiers hold K/V
    without autograd history: 13 of 21 gradients wrong, silently), streaming's failed inside autograd on a reused
    buffer. The forward is unchanged (inference without no_grad works); a backward raises with the fix."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 24, seed=3)
    with torch.no_grad():
        expected = model(ids[:, 16:], past_key_values=_prefilled(model, ids[:, :16], DynamicCache())).logits
    gpu = TieredCache.min_device_bytes(model.config, 40, block_tokens=4, device="cpu")
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with engage(name, cache, model):
            _prefilled(model, ids[:, :16], cache)
            out = model(ids[:, 16:], past_key_values=cache, labels=ids[:, 16:])
        torch.testing.assert_close(out.logits.detach(), expected, atol=1e-5, rtol=0)
        with pytest.raises(TierKVError, match=r"backward through a forward with a TieredCache.*torch\.no_grad"):
            out.loss.backward()
        assert cache.get_seq_length() == 24


def _prefilled(model, ids, cache):
    with torch.no_grad():
        model(ids, past_key_values=cache)
    return cache


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_a_backward_that_needs_other_gradients_is_refused_too(tmp_path, name):
    """Where the step's query needs no gradient (only the value projection trains), or only the K/V of an earlier
    forward had one (a soft prompt given as inputs_embeds, the model frozen), a backward still raises: the K/V
    gradients were dropped silently."""
    model = copy.deepcopy(tiny_model("llama"))
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_("v_proj" in parameter_name)
    ids, _ = prompt(1, 24, seed=3)
    gpu = TieredCache.min_device_bytes(model.config, 40, block_tokens=4, device="cpu")
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with engage(name, cache, model):
            _prefilled(model, ids[:, :16], cache)
            loss = model(ids[:, 16:], past_key_values=cache, labels=ids[:, 16:]).loss
        with pytest.raises(TierKVError, match="backward through a forward with a TieredCache"):
            loss.backward()
    model.requires_grad_(False)
    soft_prompt = model.get_input_embeddings()(ids[:, :16]).detach().requires_grad_(True)
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4, config=model.config) as cache:
        with engage(name, cache, model):
            model(inputs_embeds=soft_prompt, past_key_values=cache)
            loss = model(ids[:, 16:], past_key_values=cache, labels=ids[:, 16:]).loss
        with pytest.raises(TierKVError, match="backward through a forward with a TieredCache"):
            loss.backward()


@pytest.mark.parametrize("name", sorted(EXECUTORS))
def test_a_users_4d_mask_is_read_afresh_each_forward(tmp_path, name):
    """A 4-D mask a user passes (float, -inf where hidden: sdpa gives a fully hidden row zeros) and edits in place
    between forwards under inference_mode (whose tensors count no version): each forward's rows are its own."""
    model = tiny_model("llama", layers=3)
    ids, _ = prompt(2, 20, seed=7)
    hidden = torch.full((20, 20), float("-inf")).triu(1)  # causal
    mask = hidden.expand(2, 1, 20, 20).clone()
    mask[0, :, :, :6] = float("-inf")  # row 0: 6 padding tokens, its first 6 queries see nothing
    edited = hidden.expand(2, 1, 20, 20).clone()
    edited[1, :, :, :9] = float("-inf")
    gpu = TieredCache.min_device_bytes(model.config, 40, batch=2, block_tokens=4, device="cpu")
    with torch.inference_mode(), TieredCache(gpu_gb=f"{gpu}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4,
                                             config=model.config) as cache:  # fmt: skip
        user_mask = mask.clone()
        for expected_mask in (mask, edited):
            user_mask.copy_(expected_mask)
            expected = model(ids, attention_mask=expected_mask, past_key_values=DynamicCache()).logits
            with engage(name, cache, model):
                got = model(ids, attention_mask=user_mask, past_key_values=cache).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
            cache.reset()
