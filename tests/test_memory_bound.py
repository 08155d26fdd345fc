"""Peak RSS during decode stays within the tier budgets plus a documented constant, for both executors, with
most of the KV on disk (docs/reliability.md, "Memory").

Regression: the exact path's disk bounce buffers grew with the context and no budget counted them (RSS grew
282-433 MB over 210 MB of budgets). Now no disk I/O bounces through more than ``BOUNCE_BYTES``; the first test
sets it to 1 MiB in its child process, so layers whose disk part is 8-16 times larger must run in rounds, and
the bound is ``gpu_gb + cpu_gb + 11 * BOUNCE_BYTES + SLACK``. glibc's dynamic mmap threshold is fixed in the
child (``MALLOC_MMAP_THRESHOLD_``): otherwise the allocator keeps freed heap memory resident, which is no
buffer of tierkv's and varies from run to run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import decode_rss

SLACK = 24 * 2**20  # the interpreter, threads' stacks, index tensors, one prefill chunk's temporaries

BUDGETS = """
def budgets(executor, context):
    if executor == "streaming":
        return TieredCache.min_streaming_device_bytes(config, block_tokens=BLOCK, chunk_tokens=CHUNK) + 2**21, 4 * 2**20
    return TieredCache.min_device_bytes(config, context + 64, block_tokens=BLOCK), 4 * 2**20
"""


def test_peak_rss_during_decode_is_budgets_plus_a_constant():
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": os.getcwd()}
    results = decode_rss(BUDGETS, [("exact_gather", 8192), ("streaming", 8192)], layers=2, max_positions=8192 + 512,
                         steps=4, env=env, bounce_bytes=2**20)  # fmt: skip
    for executor, result in results.items():
        blocks = result["blocks"]
        assert blocks["disk"] > blocks["device"] + blocks["host"], (executor, blocks)  # most KV on disk
        bound = result["budgets"] + 11 * result["bounce"] + SLACK
        assert result["growth"] <= bound, (
            f"{executor}: RSS grew {result['growth'] / 2**20:.1f} MiB, over budgets "
            f"{result['budgets'] / 2**20:.1f} MiB + bounce bound + slack = {bound / 2**20:.1f} MiB")


CHILD_MODEL = r"""
import json
import psutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
from tierkv import TieredCache

torch.set_num_threads(1)
config = LlamaConfig(vocab_size=128, hidden_size=HEADS * DIM, intermediate_size=256, num_hidden_layers=LAYERS,
                     num_attention_heads=HEADS, num_key_value_heads=HEADS, head_dim=DIM,
                     max_position_embeddings=CONTEXT + 64)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
"""  # a child's model, after its LAYERS, HEADS, DIM, CONTEXT

SMALL_KV_CHILD = "LAYERS, HEADS, DIM, CONTEXT, BLOCK = 2, 8, 64, 576, 16" + CHILD_MODEL + r"""
process = psutil.Process()
with torch.inference_mode():
    model(torch.randint(2, 128, (1, 8)))
base = process.memory_info().rss
cache = TieredCache(gpu_gb="16GB", cpu_gb="4GB", block_tokens=BLOCK, config=config)
generator = torch.Generator().manual_seed(1)
with torch.inference_mode():
    for layer in range(LAYERS):
        kv = torch.randn(1, HEADS, CONTEXT, DIM, generator=generator)
        cache.update(kv, kv, layer)
    for _ in range(4):
        model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True)
stats = cache.stats()
growth = process.memory_info().rss - base
cache.close()
print(json.dumps(dict(growth=growth, kv=(CONTEXT + 4) * LAYERS * 2 * HEADS * DIM * 4, stats=stats)))
"""


def test_a_small_kv_on_a_large_budget_takes_memory_by_need():
    """``TieredCache(gpu_gb=16GB)`` holding 4.8 MB of KV allocates about that, not 1/16 of the budget per slab
    pool (1 GB before slabs grew by need), and the process's memory grows by a few times the KV."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SMALL_KV_CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    stats, kv = result["stats"], result["kv"]
    assert stats["bytes_resident"]["device"] == kv  # all of it on the device
    slabs = stats["bytes_allocated"]["device"] - stats["bytes_staging"]
    assert kv <= slabs <= 2 * kv + 2**20, f"device slabs {slabs / 2**20:.1f} MiB for {kv / 2**20:.1f} MiB of KV"
    assert stats["peak_bytes_allocated"]["device"] <= stats["budget_bytes"]["device"]
    assert result["growth"] <= 4 * kv + SLACK, f"RSS grew {result['growth'] / 2**20:.1f} MiB"


LOAD_PREFIX_CHILD = "LAYERS, HEADS, DIM, CONTEXT, BLOCK = 8, 4, 64, 6144, 256" + CHILD_MODEL + r"""
import sys, threading, time
import numpy as np
from tierkv.persist import record
from tierkv.persist.blockfile import Item, PersistentStore
from tierkv.persist.keys import Namespace, block_keys

TOKENS = CONTEXT
folder = sys.argv[1]
ids = torch.randint(2, 128, (1, TOKENS + 1), generator=torch.Generator().manual_seed(0))
namespace = Namespace.of_model(model, BLOCK)
keys = block_keys(namespace.root, ids[0].numpy().astype(np.int64), BLOCK)
store = PersistentStore(folder, 1 << 30)  # the prefix, stored as a cache with persist=True stores it
generator = torch.Generator().manual_seed(1)
for depth, key in enumerate(keys):
    kv = torch.randn(LAYERS, 2, HEADS, BLOCK, DIM, generator=generator)
    store.put([Item(key, depth, *record.encode_block(key, namespace.root, depth, kv))])
store.close()
process = psutil.Process()
cache = TieredCache(gpu_gb="8MB", cpu_gb="8MB", disk_dir=folder, block_tokens=BLOCK, persist=True, config=config)
base = peak = process.memory_info().rss
done = threading.Event()

def sample():
    global peak
    while not done.is_set():
        peak = max(peak, process.memory_info().rss)
        time.sleep(0.001)

sampler = threading.Thread(target=sample)
sampler.start()
loaded = cache.load_prefix(model, ids)
done.set()
sampler.join()
bounce = cache.runtime.disk.bounce_bytes
cache.close()
print(json.dumps(dict(growth=peak - base, loaded=loaded, prefix=loaded * LAYERS * 2 * HEADS * DIM * 4,
                      budgets=16 * 2**20, bounce=bounce)))
"""


def check_load_prefix_rss(child: str, loaded: int, *args: str) -> None:
    """Run ``child`` (:data:`LOAD_PREFIX_CHILD` or a variant) with ``args``: it must load ``loaded`` tokens while
    RSS grows by at most the budgets, the prefix once, what appending one layer takes and a constant."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["loaded"] == loaded
    layer = result["prefix"] // 8
    bound = result["budgets"] + result["prefix"] + 3 * layer + 11 * result["bounce"] + SLACK
    assert result["growth"] <= bound, (f"RSS grew {result['growth'] / 2**20:.1f} MiB loading a "
                                       f"{result['prefix'] / 2**20:.0f} MiB prefix (bound {bound / 2**20:.1f} MiB)")


def test_load_prefix_holds_the_prefix_about_once(tmp_path):
    """Regression: ``load_prefix`` held the records read, a stack of them and a permuted copy at once (RSS grew by
    ~3x the prefix beyond the budgets). Each record is copied into its layer's K/V and dropped, each layer's K/V
    dropped once appended: the prefix once, plus what appending one layer takes (bounded by the bounce buffers
    beside the layer's copies)."""
    check_load_prefix_rss(LOAD_PREFIX_CHILD, 6144, str(tmp_path))
