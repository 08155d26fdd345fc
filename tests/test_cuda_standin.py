"""The CUDA paths on the CPU stand-in (``cuda_standin``): exact tokens, and a stream/event protocol that the
stand-in's race detector accepts — and rejects as soon as one wait of it is taken away."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
from helpers import kv, make_store
from models import tiny_model
from transformers import DynamicCache

from tierkv import TieredCache, cuda_standin, settings
from tierkv.blocks import Tier
from tierkv.cuda_standin import FakeStream, StandIn
from tierkv.mover import MoveHandle
from tierkv.tiers.disk import BounceBuffer
from tierkv.tiers.memory import MemoryTier

BLOCK = 4
PROMPT, NEW = 48, 6


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """A fresh stand-in, in force for the test (prefetch of every layer, however small)."""
    with settings.override(cuda_standin=True, prefetch_min=0):
        yield cuda_standin.fresh()


def _decode(model, tmp_path, streaming: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Greedy decode with most KV on disk: (tokens, DynamicCache's tokens, the cache's stats)."""
    ids = torch.randint(2, 128, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with settings.override(cuda_standin=False):
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=DynamicCache())
    if streaming:
        budget = TieredCache.min_streaming_device_bytes(model.config, block_tokens=BLOCK, chunk_tokens=16,
                                                        device="cpu")
    else:
        budget = TieredCache.min_device_bytes(model.config, PROMPT + NEW, block_tokens=BLOCK, device="cpu")
    budget += 8 * 1024
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=BLOCK,
                     config=model.config) as cache:
        if streaming:
            with cache.streaming(model, chunk_tokens=16):
                out = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=cache)
        else:
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=cache)
        stats = cache.stats()
    return out, ref, stats


def _first(log: list[tuple[str, str, str]], agent_prefix: str, op: str) -> int:
    return next(i for i, (agent, name, _) in enumerate(log) if agent.startswith(agent_prefix) and name == op)


@pytest.mark.parametrize("streaming", [False, True], ids=["exact_gather", "streaming"])
def test_cuda_paths_on_the_standin_are_exact_and_ordered(standin, tmp_path, streaming):
    out, ref, stats = _decode(tiny_model("llama"), tmp_path, streaming=streaming)
    assert torch.equal(out, ref)
    assert stats["mover"] == "cuda-stream" and stats["blocks"]["disk"] > 0
    assert stats["bytes_moved"]["disk->device"] > 0 and stats["bytes_moved"]["host->device"] > 0
    assert stats["steps"]["last"]["transfer_s_by_link"]["disk->device"] > 0  # timed by (fake) CUDA events
    standin.check()  # no access that a GPU could run out of order
    log = standin.ops()
    ops = {(agent.rstrip("0123456789"), op) for agent, op, _ in log}
    # the copy stream did the prefetch copies, after waiting for the compute stream; the compute stream
    # waited for the copy stream before attention read staging
    assert ("stream", "copy host->device") in ops and ("stream", "wait_event") in ops
    assert ("compute", "wait_event") in ops and ("compute", "attention reads") in ops
    assert _first(log, "stream", "wait_event") < _first(log, "stream", "copy host->device")
    assert standin.pageable_copies == 0  # host slabs and bounce buffers are pinned: every H2D copy is async DMA
    assert any(op == "empty_cache" for _, op, _ in log)  # released staging and slabs went back to the driver
    gc.collect()
    assert standin.registered == {}  # every cudaHostRegister of a bounce buffer was undone when the cache closed


def test_streaming_at_its_documented_minimum_has_room_for_the_landing_buffers(standin, tmp_path):
    """min_streaming_device_bytes counts the two landing buffers: at exactly that budget the first host read
    must not fail for want of a landing buffer of one block."""
    model = tiny_model("llama")
    budget = TieredCache.min_streaming_device_bytes(model.config, block_tokens=BLOCK, chunk_tokens=16, device="cpu")
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with TieredCache(gpu_gb=f"{budget}B", cpu_gb="1MB", block_tokens=BLOCK, config=model.config) as cache, \
            cache.streaming(model, chunk_tokens=16):
        model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=cache)
        assert cache.store.transfer.scratch.landing_bytes >= cache.store.layouts[0].slot_bytes
        assert cache.stats()["bytes_moved"]["host->device"] > 0
    standin.check()


# ------------------------------------------------------------- the checker catches each missing wait
def _violations_without(monkeypatch, tmp_path, standin: StandIn, target, name: str, replacement) -> list[str]:
    monkeypatch.setattr(target, name, replacement)
    out, ref, _ = _decode(tiny_model("llama"), tmp_path)
    assert torch.equal(out, ref)  # on the CPU the data is right anyway: only the checker sees the bug
    return standin.violations


def test_compute_stream_not_waiting_for_the_copy_stream_is_caught(standin, monkeypatch, tmp_path):
    def wait_on_host_only(self: MoveHandle) -> None:  # forgets the compute stream's wait_event
        self._future.result()
        self._observed()

    found = _violations_without(monkeypatch, tmp_path, standin, MoveHandle, "wait", wait_on_host_only)
    assert any("by compute" in v and "stream" in v for v in found)


def test_a_wait_on_the_wrong_stream_is_caught(standin, monkeypatch, tmp_path):
    def wait_on_the_copy_stream(self: MoveHandle) -> None:  # as if the current stream were the wrong one
        self._future.result()
        self._observed()
        self._accel.Stream(self._device).wait_event(self._event)

    found = _violations_without(monkeypatch, tmp_path, standin, MoveHandle, "wait", wait_on_the_copy_stream)
    assert found


def test_copy_stream_not_waiting_for_the_compute_stream_is_caught(standin, monkeypatch, tmp_path):
    real = FakeStream.wait_event

    def skip_ready(self: FakeStream, event) -> None:  # the copy stream starts without waiting for compute
        if self.name != "compute":
            return None
        return real(self, event)

    found = _violations_without(monkeypatch, tmp_path, standin, FakeStream, "wait_event", skip_ready)
    assert any("stream" in v and "after attention reads" in v for v in found)


def test_a_bounce_buffer_refilled_before_its_copies_ran_is_caught(standin, monkeypatch, tmp_path):
    found = _violations_without(monkeypatch, tmp_path, standin, BounceBuffer, "fence", lambda self, event: None)
    assert any("host write" in v and "bounce" in v for v in found)


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "fence-dropped"])
def test_host_slots_freed_under_gpu_reads_are_rewritten_only_after_them(standin, monkeypatch, tmp_path, fenced):
    """The store's barrier does not block the CPU: it fences the host tier, whose next CPU write waits for the
    copies queued before the free. Without the fence the stand-in sees the write race the read."""
    if not fenced:
        monkeypatch.setattr(MemoryTier, "fence_writes", lambda self, event: None)
    store = make_store(tmp_path, device_slots=2, host_slots=16, disk_bytes=None)
    store.append(0, *kv(1, 24))  # 6 blocks: the open tail on the device, the full ones on the host
    layout = store.layouts[0]
    host = [b for b in store.table.blocks.values() if b.tier == Tier.HOST]
    assert host
    store.read_tokens(0)  # compute-stream copies out of the host slots
    store.crop(0, 20)  # frees them (the barrier runs first)
    data = standin.host_blocks((len(host), *layout.shape), layout.dtype)
    store.transfer.write_blocks(layout, Tier.HOST, [b.slot for b in host], data)  # the CPU reuses them
    if fenced:
        standin.check()
    else:
        assert any("host write" in v and "copy host->device" in v for v in standin.violations)
    store.close()


# ------------------------------------------------------------------------------ the checker itself
def test_checker_orders_accesses_by_events_only():
    s = StandIn()
    device = torch.device("cpu")
    staging = s.empty(1024, device)
    source = s.host_empty((1024,), pin=True)
    side = s.Stream(device)
    with s.on_stream(side, device):
        s.copy(staging, source)  # the copy stream writes staging
    done = s.Event()
    done.record(side)
    s.compute.wait_event(done)
    s.used(staging)  # ordered by the event
    s.check()
    with s.on_stream(side, device):
        s.copy(staging, source)
    s.used(staging)  # no wait this time
    with pytest.raises(AssertionError, match="not ordered"):
        s.check()


def test_checker_takes_host_to_host_copies_as_done_on_the_cpu():
    """torch copies host memory to host memory on the CPU whatever the stream (non_blocking or not): the buffer
    copied from may be rewritten at once, and a stream's later read of the copy is ordered after it."""
    s = StandIn()
    device = torch.device("cpu")
    bounce, out = s.host_empty((1024,), pin=True), s.host_empty((1024,), pin=True)
    staging = s.empty(1024, device)
    side = s.Stream(device)
    with s.on_stream(side, device):
        s.copy(out, bounce)
        s.host_write(bounce)  # the next read into the bounce buffer
        s.copy(staging, out)
    s.check()
    with s.on_stream(side, device):
        s.copy(staging, bounce)  # host -> device: queued on the stream
    s.host_write(bounce)  # no wait: the stream may not have read it yet
    with pytest.raises(AssertionError, match="not ordered"):
        s.check()


def test_checker_bookkeeps_host_registration():
    s = StandIn()
    s.register_host(4096, 8192, pin=True)
    s.register_host(8192, 4096, pin=True)  # overlaps the first: the driver says "already registered"
    s.unregister_host(4096, pin=True)
    s.unregister_host(4096, pin=True)  # twice
    assert s.registered == {8192: 4096}
    with pytest.raises(AssertionError, match="712"):
        s.check()
    assert any("not registered" in v for v in s.violations)


def test_prefix_reuse_and_save_load_on_the_standin(standin, tmp_path):
    """tests/test_persist.py's CUDA-only test (``test_prefix_reuse_and_save_load_on_cuda``) on the stand-in: blocks
    persisted and saved from the device and the pinned host tier, loaded back through the copy stream; tokens and
    logits as DynamicCache's, and no access the race detector finds unordered."""
    model = tiny_model("llama")
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(12))

    def generate(cache, prompt_ids):
        return model.generate(prompt_ids, max_new_tokens=NEW, do_sample=False, past_key_values=cache,
                              output_logits=True, return_dict_in_generate=True)

    def assert_same(reference, out):
        assert torch.equal(out.sequences, reference.sequences)
        for got, want in zip(out.logits, reference.logits, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    reference = generate(DynamicCache(config=model.config), ids)
    continued = generate(DynamicCache(config=model.config), reference.sequences)
    budget = TieredCache.min_device_bytes(model.config, 64, block_tokens=BLOCK, device="cpu") + 8 * 1024
    options = dict(gpu_gb=f"{budget}B", cpu_gb="16KB", disk_dir=tmp_path, block_tokens=BLOCK, persist=True,
                   config=model.config)
    with TieredCache(**options) as cold:
        assert cold.load_prefix(model, ids) == 0
        assert_same(reference, generate(cold, ids))
        assert cold.stats()["mover"] == "cuda-stream" and cold.stats()["blocks"]["disk"] > 0
        cold.save(tmp_path / "c.tkv", model=model)
    with TieredCache(**options) as warm:
        assert warm.load_prefix(model, ids) == 36
        assert_same(reference, generate(warm, ids))
    with TieredCache.load(tmp_path / "c.tkv", model=model, **options) as loaded:
        assert_same(continued, generate(loaded, reference.sequences))
    standin.check()
    gc.collect()
    assert standin.registered == {}
