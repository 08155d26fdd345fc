"""Split attention (each tier's blocks attended where they live, merged by log-sum-exp) against DynamicCache on
real model classes, with blocks on the device, host and disk tiers; prefill runs on streaming."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_same_generation, teacher_forced, use_host_kernel
from models import prompt, tiny_model
from transformers import DynamicCache

from tierkv import TieredCache, accel
from tierkv.errors import InvalidConfigError
from tierkv.hf import cache_keyword
from tierkv.hf.attention import Engagement

NEW = 8
CASES = [  # (id, family, attention implementation, sliding window)
    ("llama", "llama", "sdpa", None),
    ("llama-eager", "llama", "eager", None),
    ("mistral-sw8", "mistral", "sdpa", 8),
    ("qwen3", "qwen3", "sdpa", None),
    ("gemma2-sw8", "gemma2", "eager", 8),  # soft-capping, sliding and full layers
    ("phi3", "phi3", "sdpa", None),
]


def split(cache: TieredCache, model: torch.nn.Module) -> Engagement:
    """Decode with split attention, prefill with streaming in 8-token chunks."""
    return cache.split(model, chunk_tokens=8)


def gpu(model: torch.nn.Module, batch: int) -> str:
    """The split minimum (on the CUDA stand-in: with the landing buffers and the device scratch) and room for a
    few blocks, so that every tier holds some."""
    return f"{TieredCache.min_split_device_bytes(model.config, batch, block_tokens=4, chunk_tokens=8) + 16384}B"


def run(model, ids, mask, cache, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache, **kwargs)


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernel(request, monkeypatch):
    """Each test runs on the C kernel and on the torch version (where the C kernel does not load: no prepared
    calls either)."""
    return use_host_kernel(request.param, monkeypatch)


@pytest.mark.parametrize(("name", "family", "attn", "window"), CASES, ids=[c[0] for c in CASES])
def test_split_generation_matches_dynamic_cache(tmp_path, name, family, attn, window):
    """Batch of two with left padding: tokens equal, logits within 1e-4, blocks on all three tiers."""
    model = tiny_model(family, attn, window)
    ids, mask = prompt(2, 40, seed=3, left_pad=(0, 6))
    reference = run(model, ids, mask, DynamicCache(), prefill_chunk_size=16)
    with TieredCache(gpu_gb=gpu(model, 2), cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache:
        with split(cache, model):
            out = run(model, ids, mask, cache, prefill_chunk_size=16)
        stats = cache.stats()
        assert stats["blocks"]["device"] > 0 and stats["blocks"]["host"] > 0 and stats["blocks"]["disk"] > 0
        assert stats["bytes_moved"]["disk->host"] > 0  # decode read the disk share into host memory
        assert cache.executors["split"].read_ahead_hits > 0  # ... submitted while an earlier layer attended
        assert cache.executors["split"].staging.reserved == 0  # no device staging
    assert_same_generation(out, reference, atol=1e-4)


def test_split_beam_search_matches(tmp_path):
    """Beams share blocks and reorder rows: each step's tables follow the grid."""
    model = tiny_model("llama")
    ids, mask = prompt(1, 30, seed=4)
    reference = run(model, ids, mask, DynamicCache(), num_beams=2)
    with TieredCache(gpu_gb=gpu(model, 2), cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            split(cache, model):
        out = run(model, ids, mask, cache, num_beams=2)
    assert torch.equal(out.sequences, reference.sequences)


def test_split_bf16(tmp_path):
    """bf16 K/V, accumulated in fp32: logits to bf16 rounding at every step (teacher-forced, so a near-tie that
    bf16 rounding breaks either way cannot change the later steps' inputs)."""
    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    ids, _ = prompt(2, 40, seed=1)
    inputs, expected = teacher_forced(model, ids, NEW)
    with TieredCache(gpu_gb=gpu(model, 2), cpu_gb="24KB", disk_dir=tmp_path, block_tokens=4) as cache, \
            split(cache, model):
        for tokens, want in zip(inputs, expected):
            torch.testing.assert_close(model(tokens, past_key_values=cache).logits[:, -1], want, atol=2e-2, rtol=0)
        assert cache.stats()["blocks"]["host"] > 0 and cache.stats()["blocks"]["disk"] > 0


def test_split_decodes_4k_tokens_at_its_context_independent_minimum(tmp_path):
    """4K+ tokens with the device at ``min_split_device_bytes`` (the streaming prefill's two chunks and the open
    tails): tokens equal, logits within 1e-4; the KV lives on the host, and split stages nothing (on the CUDA
    stand-in it reserves its bounded scratch)."""
    model = tiny_model("llama")
    ids, _ = prompt(1, 4100, seed=5)
    reference = run(model, ids, None, DynamicCache())
    minimum = TieredCache.min_split_device_bytes(model.config, block_tokens=16, chunk_tokens=256, device="cpu")
    assert minimum < TieredCache.kv_bytes_per_token(model.config) * 4100 / 4  # far below the context's KV
    with TieredCache(gpu_gb=f"{minimum}B", cpu_gb="64MB", block_tokens=16, config=model.config) as cache, \
            cache.split(model, chunk_tokens=256):
        out = run(model, ids, None, cache)
        stats = cache.stats()
        assert stats["blocks"]["host"] > 0 and stats["bytes_resident"]["device"] <= minimum
        staging = cache.executors["split"].staging
        assert not staging.buffers and (staging.reserved > 0) == accel.backend(torch.device("cpu")).streams
    assert_same_generation(out, reference, atol=1e-4)


def test_split_minimum_is_context_independent_and_4x_below_gather_at_64k():
    """Llama-3-8B's shape in bf16: split's minimum (decode, and the streaming prefill before it) at least 4x below
    exact gather's at 64K tokens, on a CPU host and on CUDA (landing buffers and device scratch included); the
    torch-free sizing the planner uses gives the same bytes."""
    from transformers import LlamaConfig

    from tierkv import staging
    from tierkv.layout import SLOT_ALIGN

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, dtype=torch.bfloat16)
    assert staging.SLOT_ALIGN == SLOT_ALIGN
    for device in ("cpu", "cuda"):  # "cpu" is accelerated on the CUDA stand-in
        accelerated = accel.backend(torch.device(device)).streams
        split_bytes = TieredCache.min_split_device_bytes(config, device=device)
        gather_bytes = TieredCache.min_device_bytes(config, 65536, device=device)
        assert 4 * split_bytes <= gather_bytes, (device, split_bytes, gather_bytes)
        assert split_bytes == staging.split_device_minimum(32, 1, 32, 8, 128, 2, 256, 4096, accelerated)
    assert staging.split_device_minimum(32, 1, 32, 8, 128, 2, 256, 4096, True) > staging.split_device_minimum(
        32, 1, 32, 8, 128, 2, 256, 4096, False)  # the device scratch and landing buffers


def test_split_unentered_is_refused(tmp_path):
    model = tiny_model("llama")
    ids, _ = prompt(1, 8)
    with TieredCache(gpu_gb="1MB", block_tokens=4) as cache:
        cache.split(model)
        with pytest.raises(InvalidConfigError, match=r"cache.split\(model\) was called but never entered"):
            model(ids, past_key_values=cache)


def test_split_on_the_standin_runs_the_host_share_concurrently_and_in_order(tmp_path):
    """The CUDA path on the stand-in: the host share's query goes down on the mover's stream after it waited for
    the compute stream, the mover's thread waits for that copy before the kernel reads it, the result goes up on
    the same stream, the compute stream waits for it; the device share is attended on the compute stream
    meanwhile, from the slab (no transient copy of it), within the reserved scratch. No unordered access."""
    from tierkv import cuda_standin, settings

    model = tiny_model("llama")
    ids, _ = prompt(1, 40, seed=2)
    reference = run(model, ids, None, DynamicCache())
    with settings.override(cuda_standin=True):
        standin = cuda_standin.fresh()
        budget = TieredCache.min_split_device_bytes(model.config, block_tokens=4, chunk_tokens=8, device="cpu")
        with TieredCache(gpu_gb=f"{budget + 16384}B", cpu_gb="1MB", block_tokens=4) as cache, \
                cache.split(model, chunk_tokens=8):
            out = run(model, ids, None, cache)
            split_executor = cache.executors["split"]
            assert cache.stats()["blocks"]["device"] > 0 and cache.stats()["blocks"]["host"] > 0
            assert split_executor.staging.reserved > 0 and not split_executor.staging.buffers  # counted, not staged
        standin.check()
    assert torch.equal(out.sequences, reference.sequences)
    log = standin.log
    mover = next(agent for agent, op, _ in log if agent.startswith("thread") and "mover" in agent)
    stream = next(agent for agent, op, _ in log if agent.startswith("stream"))
    down = [i for i, (agent, op, _) in enumerate(log) if agent == stream and op == "copy device->host"]
    assert down, "the query never went down on the mover's stream"
    ops = [j for j, (agent, _, _) in enumerate(log) if agent == stream]  # the stream's own order (agents interleave)
    for i in down[:3]:
        before, after = ops[ops.index(i) - 1], ops[ops.index(i) + 1]
        assert log[before][:2] == (stream, "wait_event")  # after the compute stream's work so far
        assert log[after][:2] == (stream, "record")
        event = log[after][2]
        waited = next(j for j in range(i, len(log)) if log[j] == (mover, "wait", f"synchronize {event}"))
        kernel = next(j for j in range(i, len(log)) if log[j][:2] == (mover, "host write"))
        assert waited < kernel
        up = next(j for j in range(kernel, len(log)) if log[j][:2] == (stream, "copy host->device"))
        done = next(j for j in range(up, len(log)) if log[j][:2] == (stream, "record"))
        assert any(log[j] == ("compute", "wait_event", log[done][2]) for j in range(done, len(log)))


def test_demo_runs_split_exactly_on_every_tier(tmp_path):
    """``tierkv demo --executor split``: tokens equal to DynamicCache's with KV on all three tiers."""
    import json

    from tierkv.cli import main

    out = tmp_path / "demo.json"
    rc = main(["demo", "--random-model", "--context", "1024", "--executor", "split", "--block-tokens", "16",
               "--prefill-chunk", "256", "--chunk-tokens", "256", "--max-new-tokens", "4", "--disk-dir",
               str(tmp_path / "disk"), "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and result["executor"] == "split" and result["tokens_match_reference"] is True
    assert all(result["bytes_resident"][tier] > 0 for tier in ("device", "host", "disk"))


def test_a_layers_prepared_table_follows_its_grid_and_its_pools(tmp_path, kernel):
    """On a CPU host a layer-step is one kernel call over a table across the tiers, kept between steps: a step
    that changes nothing reuses it, one whose device pool's last chunk was given back and another added (same
    count, other memory: the kept call holds only addresses) builds it again, and so does one that opens a new
    block column. Logits stay DynamicCache's."""
    from tierkv.blocks import Tier

    if accel.backend(torch.device("cpu")).streams:
        pytest.skip("the one-call table is the CPU host's path (on the CUDA stand-in the tiers run concurrently)")
    model, plain = tiny_model("llama"), copy.deepcopy(tiny_model("llama"))  # `split` binds `model` to its cache
    ids, _ = prompt(1, 37, seed=6)  # the last block holds 1 of 4 tokens: 3 steps fit before a new column
    reference = DynamicCache()
    want = [plain(ids, past_key_values=reference).logits[:, -1]]
    with TieredCache(gpu_gb=gpu(model, 1), cpu_gb="1MB", block_tokens=4) as cache, split(cache, model):
        got = [model(ids, past_key_values=cache).logits[:, -1]]
        executor = cache.executors["split"]
        token = want[-1].argmax(-1, keepdim=True)
        pool = cache.store.tiers[Tier.DEVICE].pools[cache.store.layouts[0].slot_bytes]
        pool.add_chunk(4)  # an empty last chunk (the next three steps open no column: nothing is placed in it)

        def step() -> dict:
            want.append(plain(token, past_key_values=reference).logits[:, -1])
            got.append(model(token, past_key_values=cache).logits[:, -1])
            return dict(executor._here)

        kept = step()  # 38 tokens
        now = step()
        assert all(now[layer] is entry for layer, entry in kept.items())  # nothing changed: reused
        pool.drop_last_chunk()
        pool.add_chunk(4)
        kept, now = now, step()
        assert all(now[layer] is not entry for layer, entry in kept.items())  # the pool's last chunk is another
        assert cache.store.seq_length(0) == 40
        kept, now = now, step()
        assert all(now[layer] is not entry for layer, entry in kept.items())  # a new column
        assert cache.stats()["blocks"]["device"] > 0 and cache.stats()["blocks"]["host"] > 0
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_key_that_overflowed_makes_its_row_nan_as_in_dynamic_cache(tmp_path, value):
    """A model whose key overflows at a decode step (NaN or inf in row 1's new key, every tier in use): split gives
    that row NaN logits from then on, as DynamicCache does (it decoded finite, other tokens: the host kernel dropped
    the key), and the other row is unchanged."""
    model = tiny_model("llama")
    ids, mask = prompt(2, 40, seed=4)
    calls = [0]

    def overflow(module, args, output):
        calls[0] += 1
        if calls[0] == 3:  # the prefill, a decode step, then this one
            output = output.clone()
            output[1, -1, 0] = value
        return output

    outputs = {}
    for name in ("dynamic", "split"):
        calls[0] = 0
        hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(overflow)
        try:
            if name == "dynamic":
                outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                               output_logits=True, return_dict_in_generate=True,
                                               **{cache_keyword(model): DynamicCache()})
                continue
            with TieredCache(gpu_gb="128KB", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=4) as cache, \
                    cache.split(model, chunk_tokens=8):  # fmt: skip
                outputs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                               output_logits=True, return_dict_in_generate=True,
                                               **{cache_keyword(model): cache})
                assert cache.stats()["blocks"]["disk"] > 0
        finally:
            hook.remove()
    want = torch.stack(outputs["dynamic"].logits)
    got = torch.stack(outputs["split"].logits)
    assert want[:, 1].isnan().any() and torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=0, atol=1e-4)


def test_the_device_share_is_prepared_once_per_grid_and_its_ops_do_not_grow_with_it(monkeypatch):
    """On the CUDA path the device share's tables (gather indices, key positions) are device tensors made when
    the layer's grid changes, not each step, and a step's device share queues the same ops at 3 or 14 blocks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tierkv import cuda_standin, settings
    from tierkv.attention import host_kernel
    from tierkv.attention import split as split_module

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    prepared, ops = [], []
    real_prepare, real_attend = host_kernel.prepare_torch, split_module._DeviceShare.attend

    def prepare(*args, **kwargs):
        prepared.append(1)
        return real_prepare(*args, **kwargs)

    def attend(self, *args, **kwargs):
        if self.calls and self.pool is not None:  # prepared: count what a step queues
            with Count() as count:
                result = real_attend(self, *args, **kwargs)
            ops.append(count.ops)
            return result
        return real_attend(self, *args, **kwargs)

    monkeypatch.setattr(host_kernel, "prepare_torch", prepare)
    monkeypatch.setattr(split_module._DeviceShare, "attend", attend)
    model = tiny_model("llama")
    layers, steps = model.config.num_hidden_layers, 24
    for context in (40, 200):
        prepared.clear()
        ids, _ = prompt(1, context, seed=5)
        reference = model.generate(ids, max_new_tokens=steps, do_sample=False, past_key_values=DynamicCache())
        with settings.override(cuda_standin=True):
            standin = cuda_standin.fresh()
            with TieredCache(gpu_gb="64MB", cpu_gb="1MB", block_tokens=16) as cache, \
                    cache.split(model, chunk_tokens=1024):  # one piece: a quarter of 1,024 tokens per row
                out = model.generate(ids, max_new_tokens=steps, do_sample=False, past_key_values=cache)
                assert cache.stats()["blocks"]["device"] > 0
            standin.check()
        assert torch.equal(out, reference)
        grids = -(-(context + steps) // 16) - context // 16 + 1  # the first step's, and one per new block
        assert 0 < len(prepared) <= layers * grids < layers * (steps - 1)
    assert ops and len(set(ops)) == 1, ops  # the same ops every step, at either context
