"""Small builders shared by the store tests, and the child process that samples RSS during decode."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from tierkv.blocks import Tier
from tierkv.policy import make_policy
from tierkv.store import KVStore
from tierkv.tiers.disk import DiskTier
from tierkv.tiers.memory import MemoryTier

SLOT = 4096  # every test layout below fits one 4 KiB slot per block


@contextlib.contextmanager
def held_before(module: torch.nn.Module, call: int = 1) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Another thread's ``call``-th forward through ``module`` waits before it (the test's own thread passes):
    ``(between, resume)``: set when it waits, and what lets it go (an unset ``resume`` lets it go after 60 s)."""
    between, resume = threading.Event(), threading.Event()
    main, calls = threading.get_ident(), [0]

    def hold(*_: object) -> None:
        if threading.get_ident() != main and not resume.is_set():
            calls[0] += 1
            if calls[0] == call:
                between.set()
                resume.wait(60)

    hook = module.register_forward_pre_hook(hold)
    try:
        yield between, resume
    finally:
        resume.set()
        hook.remove()


@contextlib.contextmanager
def tiny_tmpfs(path: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A real filesystem of ``size`` (a tmpfs mounted at ``path``; with ``inodes``, that many files and folders at
    most) that runs out of space; the test skips where it cannot be mounted (not root). Unmounted lazily at the
    end: a store a failed assertion left open does not keep it mounted."""
    options = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "")
    with mounted(path, "tmpfs", options) as mount:
        yield mount


@contextlib.contextmanager
def mounted(path: Path, kind: str, options: str = "") -> Iterator[Path]:
    """A filesystem of ``kind`` mounted at ``path`` (created), unmounted lazily at the end; the test skips where it
    cannot be mounted (not root)."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", kind, *(["-o", options] if options else []), kind,
                                            str(path)], capture_output=True).returncode:  # fmt: skip
        pytest.skip(f"cannot mount a {kind} here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def make_store(tmp_path, device_slots: int, host_slots: int, disk_bytes: int | None = 2**22,
               block_tokens: int = 4, staging_bytes: int = 0, extent_slots: int = 4) -> KVStore:
    """A store whose tiers hold the given number of 4 KiB slots (staging bytes come on top); small slab
    chunks and disk extents, so growth, evacuation and run reservations are exercised."""
    device = MemoryTier(Tier.DEVICE, device_slots * SLOT + staging_bytes, torch.device("cpu"), chunk_bytes=2 * SLOT)
    host = MemoryTier(Tier.HOST, host_slots * SLOT, torch.device("cpu"), chunk_bytes=2 * SLOT)
    disk = DiskTier(tmp_path / "disk", disk_bytes, extent_bytes=extent_slots * SLOT) if disk_bytes is not None else None
    return KVStore(device, host, disk, make_policy("lru"), block_tokens)


def kv(batch: int, tokens: int, heads: int = 2, dim: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, dim, generator=generator)
    return keys, torch.randn(batch, heads, tokens, dim, generator=generator)


STEP_CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=128)
"""Three layers of 2 KV heads x 16: the model config of the steps :func:`kv_step` makes."""


def kv_step(tokens: int, seed: int) -> torch.Tensor:
    """One layer's keys (or values) of a step of ``tokens`` tokens for :data:`STEP_CONFIG`, ``[1, 2, tokens, 16]``."""
    return torch.randn(1, 2, tokens, 16, generator=torch.Generator().manual_seed(seed))


def forward_steps(cache: Any, tokens: int, seed: int, layers: int = 3) -> None:
    """A forward's updates without a model, layer by layer: keys ``kv_step(tokens, seed * 10 + layer)``, values
    their negation."""
    for layer in range(layers):
        states = kv_step(tokens, seed * 10 + layer)
        cache.update(states, -states, layer)


DECODE_RSS_CHILD = r"""
import contextlib, json, sys, tempfile, threading, time
import psutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
from tierkv import TieredCache
from tierkv.tiers import disk as disk_module

spec = json.loads(sys.argv[1])
if spec["bounce_bytes"] is not None:
    disk_module.BOUNCE_BYTES = spec["bounce_bytes"]
torch.set_num_threads(1)
LAYERS, HEADS, DIM, BLOCK, CHUNK = spec["layers"], 8, 64, 256, 1024
config = LlamaConfig(vocab_size=128, hidden_size=512, intermediate_size=256, num_hidden_layers=LAYERS,
                     num_attention_heads=8, num_key_value_heads=HEADS, head_dim=DIM,
                     max_position_embeddings=spec["max_positions"])
#BUDGETS
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
process = psutil.Process()
with torch.inference_mode():
    model(torch.randint(2, 128, (1, 8)))
results = {}
for executor, context in spec["runs"]:
    gpu, cpu = budgets(executor, context)
    base = process.memory_info().rss
    peak, done = [base], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)  # a failure above exits with its traceback, not hangs
    sampler.start()
    with tempfile.TemporaryDirectory(dir=spec["directory"]) as directory:
        cache = TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=directory, block_tokens=BLOCK, config=config)
        streaming = cache.streaming(model, chunk_tokens=CHUNK) if executor == "streaming" else contextlib.nullcontext()
        generator = torch.Generator().manual_seed(1)
        with torch.inference_mode(), streaming:
            for start in range(0, context, 512):  # a chunked prefill without its quadratic cost
                for layer in range(LAYERS):
                    kv = torch.randn(1, HEADS, 512, DIM, generator=generator)
                    cache.update(kv, kv, layer)
            for _ in range(spec["steps"]):
                model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
        blocks = cache.stats()["blocks"]
        cache.close()
    done.set()
    sampler.join()
    results[executor] = dict(growth=peak[0] - base, budgets=gpu + cpu, blocks=blocks,
                             bounce=disk_module.BOUNCE_BYTES)
print(json.dumps(results))
"""


def decode_rss(budgets: str, runs: Sequence[tuple[str, int]], *, layers: int, max_positions: int, steps: int,
               env: dict[str, str], bounce_bytes: int | None = None,
               directory: str | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Peak RSS growth while a fresh interpreter prefills ``context`` random tokens into a ``TieredCache`` and
    decodes ``steps`` tokens of a tiny random Llama (256-token blocks, ``layers`` layers, 8 kv heads of 64), once
    per ``(executor, context)`` of ``runs`` ("exact_gather" or "streaming", chunks of 1,024 tokens), with a thread
    sampling RSS every 2 ms. ``budgets`` is code that defines ``budgets(executor, context) -> (gpu bytes, cpu
    bytes)`` (it sees ``config``, ``BLOCK``, ``CHUNK`` and ``TieredCache``); ``bounce_bytes`` replaces the disk
    tier's ``BOUNCE_BYTES``; the disk tier lives in a temporary directory under ``directory``. Returns, per
    executor: ``growth`` (peak RSS minus RSS before the cache), ``budgets`` (gpu + cpu), the cache's ``blocks`` per
    tier, and ``bounce`` (``BOUNCE_BYTES``)."""
    spec = dict(runs=list(runs), layers=layers, max_positions=max_positions, steps=steps, bounce_bytes=bounce_bytes,
                directory=directory)  # fmt: skip
    code = DECODE_RSS_CHILD.replace("#BUDGETS", budgets)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def prefix_worker(model, ids, block_tokens: int, new_tokens: int, **options) -> tuple[torch.Tensor, int, dict]:
    """One worker: a fresh cache, load what it can of ``ids``' prefix, generate; returns (tokens, tokens loaded,
    stats)."""
    from tierkv import TieredCache

    with TieredCache(block_tokens=block_tokens, **options) as cache:
        loaded = cache.load_prefix(model, ids)
        out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, do_sample=False)
        cache.flush()
        return out, loaded, cache.stats()


def saves_while_generating(cache, model, generate, directory: Path, most: int) -> tuple[list, list[Path]]:
    """Run ``generate()`` on a worker thread and save ``cache`` from this one (up to ``most`` snapshots under
    ``directory``) until the worker ends: the worker's result (empty if it raised) and the files saved."""
    import threading

    result: list = []
    worker = threading.Thread(target=lambda: result.append(generate()))
    worker.start()
    paths: list[Path] = []
    while worker.is_alive() and len(paths) < most:
        if cache.get_seq_length():
            paths.append(directory / f"snapshot{len(paths)}.tkv")
            cache.save(paths[-1], model=model)
    worker.join()
    return result, paths


def assert_same_generation(out, reference, atol: float) -> None:
    """``generate`` outputs with scores: the same tokens, and logits within ``atol`` step by step."""
    assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(out.logits, reference.logits, strict=True):
        torch.testing.assert_close(got, expected, atol=atol, rtol=0)



def assert_same_generation_up_to_ties(out, reference, atol: float) -> None:
    """Greedy ``generate`` outputs of a path that rounds differently (bf16 K/V attended in fp32): logits within
    ``atol`` while a row's tokens agree; a row may take another token only where the reference's top two logits
    are within ``atol`` (a tie at that precision), and is compared no further after it."""
    start = reference.sequences.shape[1] - len(reference.logits)
    live = torch.ones(reference.sequences.shape[0], dtype=torch.bool)
    for step, (got, expected) in enumerate(zip(out.logits, reference.logits, strict=True)):
        torch.testing.assert_close(got[live], expected[live], atol=atol, rtol=0)
        differ = live & (out.sequences[:, start + step] != reference.sequences[:, start + step])
        if differ.any():
            top = expected[differ].float().topk(2, dim=-1).values
            margin = top[:, 0] - top[:, 1]
            assert (margin <= atol).all(), f"step {step}: another token where the reference's margin is {margin}"
            live &= ~differ


ROOT = Path(__file__).resolve().parents[1]


def build_ext(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` of the checkout into ``out`` (what ``pip install`` runs), never into the checkout."""
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out / "lib"),
               "--build-temp", str(out / "tmp"), "--parallel", str(os.cpu_count() or 1)]  # fmt: skip
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip


def check_extension_loads_first(kernel: Any, stem: str, lib: Path, tmp_path: Path, monkeypatch: Any,
                                caplog: Any) -> None:
    """``setup.py build_ext`` (what ``pip install`` runs; ``lib``: what it built, the ``built_extensions``
    fixture) builds ``tierkv/attention/<stem>*.so`` with the source's hash compiled in, and ``kernel``'s loader (a
    module with ``extension``, ``_built_from``, ``source_digest``, a cached ``_build`` and ``available``) takes it
    before building anything itself."""
    import ctypes
    import logging

    from tierkv import settings

    (built,) = (lib / "tierkv" / "attention").glob(f"{stem}*.so")
    assert kernel._built_from(ctypes.CDLL(str(built))) == kernel.source_digest()
    caplog.set_level(logging.INFO, logger="tierkv")
    monkeypatch.setattr(kernel, "extension", lambda: built)
    kernel._build.cache_clear()
    try:
        with settings.override(cache_dir=tmp_path / "cache"):
            assert kernel.available()
        assert "the extension built at install" in caplog.text and not (tmp_path / "cache").exists()
    finally:
        kernel._build.cache_clear()


def use_host_kernel(variant: str, monkeypatch: Any) -> str:
    """Run the test on the host kernel's ``variant``: "native" (the C kernel; skipped where it does not load) or
    "torch" (the torch version, as where the C kernel cannot be built: no prepared calls either)."""
    import pytest

    from tierkv.attention import host_kernel
    from tierkv.io.base import EngineUnavailableError

    if variant == "torch":
        monkeypatch.setattr(host_kernel, "paged_attention", host_kernel.paged_attention_torch)
        monkeypatch.setattr(host_kernel, "_build", lambda: EngineUnavailableError("unloaded by the test", "none"))
    elif not host_kernel.available():
        pytest.skip(f"the C kernel does not load here: {host_kernel._build()}")
    return variant


def teacher_forced(model: Any, ids: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A ``DynamicCache`` run of ``steps`` greedy steps from ``ids``: each step's input tokens and last logits, so
    another cache can be fed the same inputs (a near-tie broken either way cannot change the later steps)."""
    from transformers import DynamicCache

    reference, inputs, expected = DynamicCache(), [ids], []
    for _ in range(steps):
        expected.append(model(inputs[-1], past_key_values=reference).logits[:, -1])
        inputs.append(expected[-1].argmax(-1, keepdim=True))
    return inputs, expected


def conversation_records(path: Path) -> list[tuple[dict, bytes]]:
    """Every record of a conversation file: (header, payload)."""
    from tierkv.persist import record

    out, size = [], path.stat().st_size
    with open(path, "rb") as f:
        while f.tell() < size:
            header, payload = record.read(f, str(path))
            out.append((header, bytes(payload)))
    return out


def stored_blocks(directory: Any) -> int:
    """The blocks the persistent store under ``directory`` lists."""
    from tierkv.persist.blockfile import PersistentStore

    store = PersistentStore(directory, 2**30)
    try:
        return store.stats()["blocks"]
    finally:
        store.close()


def reuse_prefix(model: Any, ids: Any, directory: Any) -> int:
    """A later request on a persistent cache in ``directory`` (8-token blocks): the tokens ``load_prefix`` loads
    for ``ids``, after checking that the rest's last logits equal a fresh ``DynamicCache`` run of the model."""
    import torch
    from transformers import DynamicCache

    from tierkv import TieredCache

    with TieredCache(gpu_gb="1MB", cpu_gb="1MB", disk_dir=directory, persist=True, block_tokens=8,
                     config=model.config) as cache, torch.no_grad():  # fmt: skip
        loaded = cache.load_prefix(model, ids)
        logits = model(input_ids=ids[:, loaded:], past_key_values=cache).logits[0, -1]
    with torch.no_grad():
        reference = model(input_ids=ids, past_key_values=DynamicCache()).logits[0, -1]
    torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)
    return loaded

