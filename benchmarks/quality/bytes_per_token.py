"""KV bytes read per decoded token and decode step time, exact vs sparse, a real model with most of the KV on disk.

    python benchmarks/quality/bytes_per_token.py --reference RUN/smollm2 --prompt needle/4096/d0.50/#0
    python benchmarks/quality/bytes_per_token.py --reference RUN/gemma3 --prompt needle/16384/d0.50/#0
    python benchmarks/quality/bytes_per_token.py ...   (for the step times)

The prompt's full-attention KV (saved by ``tierkv eval --stage reference``; the model is the one that run
named) is written into one TieredCache whose device budget is the streaming minimum plus 10% of the KV it
holds (a sliding-window layer: its window) plus the key summaries (and the rest copy of
``--rest-bits``) plus 16 MiB (the sparse selection) and whose host budget is 1 MiB, so most blocks are on
disk. Then, interleaved in rounds on that same cache (the placement does not change between them): STEPS
decode steps with exact streaming attention and STEPS with ``cache.sparse`` at each budget. Per step: the KV
bytes read into the device over every link (``stats()["bytes_moved"]``: device->device, host->device,
disk->device) and the wall time (median), after one uncounted warm-up step per method (the first sparse step
reads every full block once to summarise it).
Each step feeds the same token at the next position, so every method decodes the same context length.
Then the model alone: the same model over a DynamicCache of the prompt's first MODEL_ALONE_TOKENS tokens, whose
attention costs next to nothing — the part of every step that no attention can remove, so ``exact / model
alone`` is the most any sparse step could be faster here (Amdahl).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tierkv import TieredCache, models  # noqa: E402
from tierkv.hf import cache_keyword  # noqa: E402
from tierkv.planner import kv_summary_bytes  # noqa: E402
from tierkv.quality import run_folder  # noqa: E402
from tierkv.staging import rest_copy_bytes  # noqa: E402

READ_LINKS = ("device->device", "host->device", "disk->device")
MODEL_ALONE_TOKENS = 256  # the model alone: a context this short makes its attention next to free


def read_bytes(cache) -> int:
    moved = cache.stats()["bytes_moved"]
    return sum(moved.get(link, 0) for link in READ_LINKS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--prompt", default="needle/4096/d0.50/#0")
    parser.add_argument("--budgets", default="0.02,0.05,0.1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--rest-bits", type=int, default=0, help="sparse: the blocks not read attended from a copy "
                        "of this many bits on the device (its bytes added to the device budget)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    prompts, _ = run_folder.load_reference(args.reference)
    prompt = next(p for p in prompts if p.key == args.prompt)
    kv = run_folder.load_kv(args.reference, prompt)
    name = run_folder.read_reference(args.reference)["model"]
    model, _ = models.load(name)
    kv_bytes = TieredCache.kv_bytes_held(model.config, len(prompt.ids) - 1, kv[0][0].dtype)
    gpu = TieredCache.min_streaming_device_bytes(model.config, block_tokens=args.block_tokens) + kv_bytes // 10 \
        + kv_summary_bytes(kv_bytes, args.block_tokens) \
        + rest_copy_bytes(kv_bytes, args.rest_bits, kv[0][0].element_size(), kv[0][0].shape[-1]) \
        + (16 << 20)  # the key summaries (and rest copy), and room for the sparse selection as the context grows
    budgets = [float(b) for b in args.budgets.split(",")]
    methods = ["exact"] + [f"sparse@{b:g}" for b in budgets]
    per_step: dict[str, list[int]] = {m: [] for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="tierkv-bytes-") as tmp, torch.inference_mode(), \
            TieredCache(gpu_gb=f"{gpu}B", cpu_gb="1MiB", disk_dir=tmp, block_tokens=args.block_tokens,
                        config=model.config) as cache:
        with cache.streaming(model):
            for i, (keys, values) in enumerate(kv):
                cache.update(keys, values, i)
        token = torch.tensor([[prompt.ids[-1]]])
        for method in methods:  # warm-up, not counted: the first sparse step summarises every full block once
            with cache.streaming(model) if method == "exact" else \
                    cache.sparse(model, tokens=float(method.split("@")[1]), rest_bits=args.rest_bits):
                model(input_ids=token, **{cache_keyword(model): cache}, logits_to_keep=1)
        resident = cache.stats()["bytes_resident"]  # after a step: sliding-window layers have freed their front
        for _ in range(args.rounds):
            for method in methods:
                context = cache.streaming(model) if method == "exact" else \
                    cache.sparse(model, tokens=float(method.split("@")[1]), rest_bits=args.rest_bits)
                with context:
                    for _ in range(args.steps):
                        before, started = read_bytes(cache), time.perf_counter()
                        model(input_ids=token, **{cache_keyword(model): cache}, logits_to_keep=1)
                        times[method].append(time.perf_counter() - started)
                        per_step[method].append(read_bytes(cache) - before)
        speculation = cache.stats().get("sparse", {}).get("speculation")
        alone = model_alone_step(model, prompt.ids[:MODEL_ALONE_TOKENS], args.rounds * args.steps)
    print(f"{name}, {prompt.key}: {len(prompt.ids):,} tokens, KV {kv_bytes / 2**20:.0f} MiB; resident "
          + ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in resident.items()))
    exact_bytes, exact_time = statistics.median(per_step["exact"]), statistics.median(times["exact"])
    print(f"{'method':<12} {'MiB read/token':>15} {'vs exact':>9} {'step ms (median)':>17} {'speed-up':>9}")
    for method in methods:
        b, t = statistics.median(per_step[method]), statistics.median(times[method])
        print(f"{method:<12} {b / 2**20:>15.2f} {exact_bytes / b:>8.1f}x {1000 * t:>17.0f} {exact_time / t:>8.1f}x")
    print(f"{'model alone':<12} {'-':>15} {'-':>9} {1000 * alone:>17.0f} {exact_time / alone:>8.1f}x "
          f"(the most possible; {MODEL_ALONE_TOKENS} tokens in a DynamicCache)")
    print(f"speculative disk reads (every sparse step, warm-up included): {speculation}")
    return 0


def model_alone_step(model, ids: list[int], steps: int) -> float:
    """Median decode step of ``model`` over a DynamicCache of ``ids`` (greedy, ``steps`` steps after one warm-up)."""
    cache = DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    out = model(input_ids=torch.tensor([ids]), **{keyword: cache}, logits_to_keep=1)
    times = []
    for _ in range(steps + 1):
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        out = model(input_ids=token, **{keyword: cache}, logits_to_keep=1)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


if __name__ == "__main__":
    sys.exit(main())
