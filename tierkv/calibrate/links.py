"""Memory links: host memcpy, block gathers within the device tier, the store's own gather, and PCIe.

``device->device`` is measured three ways over the same bytes (a plain copy, ``index_select``, one ``copy_``
per block) so the price of gathering scattered blocks is a ratio, and once as the executors really run it:
``KVStore.read_into`` over a layer larger than the CPU's last-level cache. On CUDA, ``host->device`` and
``device->host`` are pinned and pageable copies each way, and both ways at once on two streams.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from tierkv.calibrate.config import BenchConfig
from tierkv.calibrate.kv import HEAD_DIM, KV_DTYPE, KV_HEADS, KV_TOKEN_BYTES, bench_store, block_tokens, kv_tensor
from tierkv.calibrate.report import SILENT, Progress, point_cost
from tierkv.calibrate.results import Measurement
from tierkv.calibrate.timing import inner_repeats, median_cuda_seconds, median_seconds, timer_for
from tierkv.units import format_bytes


def measure_memcpy(sizes: Sequence[int], cfg: BenchConfig, progress: Progress = SILENT) -> list[Measurement]:
    """host->host: one ``copy_`` of ``size`` bytes between CPU tensors (torch uses every core)."""
    progress.phase("host memcpy", [point_cost(size, cfg, inner_repeats(size)) for size in sizes])
    src = torch.ones(max(sizes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    out = []
    for size in sizes:
        s, d = src[:size], dst[:size]
        t = median_seconds(
            functools.partial(d.copy_, s), warmup=cfg.warmup, repeats=cfg.repeats, inner=inner_repeats(size)
        )
        out.append(Measurement("host->host", "memcpy", size, size, 1, t))
        progress.point()
    return out


GATHER_METHODS = ("plain copy", "gather index_select", "gather per-block copy_")


def _gather_inner(method: str, size: int, blocks: int) -> int:
    """Operations per timed sample of a gather point: ~16 MiB (:func:`inner_repeats`), per block for the per-block
    method."""
    return inner_repeats(size) if method != "gather per-block copy_" else max(1, inner_repeats(size) // blocks)


def measure_gather(sizes: Sequence[int], cfg: BenchConfig, device: torch.device,
                   progress: Progress = SILENT) -> list[Measurement]:
    """device->device: gather ``size // block`` blocks from random slots of a 2x larger pool.

    Three ways of moving the same bytes into the staging tensor: one plain contiguous copy (the ceiling),
    ``index_select(out=)`` (one call) and a ``copy_`` per block (what a naive gather does).
    """
    block = cfg.block_bytes
    sizes = [s for s in sizes if s >= block]
    if not sizes:
        return []
    progress.phase(f"block gather on {device} (a plain copy, index_select, a copy per block)",
                   [point_cost(size, cfg, _gather_inner(method, size, size // block))
                    for size in sizes for method in GATHER_METHODS])
    n_pool = 2 * max(sizes) // block
    pool = torch.ones(n_pool, block, dtype=torch.uint8, device=device)  # [slots, block bytes]
    staging = torch.empty(max(sizes) // block, block, dtype=torch.uint8, device=device)
    timer = timer_for(device)
    rng = np.random.default_rng(0)
    out = []
    for size in sizes:
        k = size // block
        slots = torch.from_numpy(rng.permutation(n_pool)[:k]).to(device)  # scattered, like a real table
        slot_list = slots.tolist()
        dst = staging[:k]
        plain_src = pool[:k]

        def per_block(dst: torch.Tensor = dst, slot_list: list[int] = slot_list) -> None:
            for i, slot in enumerate(slot_list):
                dst[i].copy_(pool[slot])

        ops = {
            "plain copy": lambda dst=dst, src=plain_src: dst.copy_(src),
            "gather index_select": lambda dst=dst, slots=slots: torch.index_select(pool, 0, slots, out=dst),
            "gather per-block copy_": per_block,
        }
        for method in GATHER_METHODS:
            t = timer(ops[method], warmup=cfg.warmup, repeats=cfg.repeats, inner=_gather_inner(method, size, k))
            out.append(
                Measurement(
                    "device->device", method, size, size, 1 if method != "gather per-block copy_" else k, t
                )
            )
            progress.point()
    return out


def measure_store_gather(sizes: Sequence[int], cfg: BenchConfig, device: torch.device,
                         progress: Progress = SILENT) -> list[Measurement]:
    """The exact executors' gather as the runtime runs it: ``KVStore.read_into`` of ``size`` bytes of one
    layer into a staging tensor ``[2, 1, H_kv, T, D]``, from blocks on the device tier (``device->device``)
    and on the host tier (``host->device``).

    Each block ``[2, H_kv, block_tokens, D]`` (fp16, 8 KV heads x 128, ``block_bytes``) lands as strided
    per-head slices, with the store's per-segment bookkeeping. Consecutive reads walk through a
    ``gather_pool_bytes`` layer, so they read memory that is not in the CPU's last-level cache, as a decode
    step over a long context does (the plain gather series above reuse one pool and can stay cache-resident).
    A phase per source: writing its layer into the store first takes tens of seconds at the default size.
    """
    from tierkv.blocks import Tier

    token_bytes, tokens_per_block = KV_TOKEN_BYTES, block_tokens(cfg)
    block = tokens_per_block * token_bytes
    sizes = [s - s % block for s in sizes if block <= s <= cfg.gather_pool_bytes // 4]
    if not sizes:
        return []
    tokens = cfg.gather_pool_bytes // block * tokens_per_block
    timer = timer_for(device)
    staging = torch.empty(2, 1, KV_HEADS, max(sizes) // token_bytes, HEAD_DIM, dtype=KV_DTYPE, device=device)
    out = []
    for source, link in ((Tier.DEVICE, "device->device"), (Tier.HOST, "host->device")):
        slack = 4 * block  # the open tail block (kept on the device) and slab rounding
        pool = tokens * token_bytes
        where = device if source == Tier.DEVICE else "host"
        progress.phase(f"the store's own gather (KVStore.read_into) from {where} blocks, after writing its "
                       f"{format_bytes(pool)} layer", [point_cost(size, cfg, inner_repeats(size)) for size in sizes])
        store = bench_store(cfg, pool + slack if source == Tier.DEVICE else slack, pool + slack, device)
        kv = kv_tensor(tokens, device)
        store.append(0, kv, kv)
        del kv
        runs = store.plan_read(0, 0, tokens).only(source).parts[0].runs  # where the source's blocks sit (row 0)
        first = runs[0].column * tokens_per_block
        last = (runs[-1].column + runs[-1].hi - runs[-1].lo) * tokens_per_block
        for size in sizes:
            n = size // token_bytes
            plans = itertools.cycle([store.plan_read(0, start, start + n).only(source)
                                     for start in range(first, last - n + 1, n)])
            t = timer(lambda store=store, plans=plans: store.read_into(0, next(plans), staging),
                      warmup=cfg.warmup, repeats=cfg.repeats, inner=inner_repeats(size))
            out.append(Measurement(link, "store read_into", size, size, 1, t))
            progress.point()
    return out


def measure_cuda_links(sizes: Sequence[int], cfg: BenchConfig, device: torch.device,
                       progress: Progress = SILENT) -> list[Measurement]:
    """host->device and device->host, pinned and pageable, and both directions at once (pinned)."""
    progress.phase("host<->device copies", [point_cost(6 * size, cfg, inner_repeats(size)) for size in sizes])
    n = max(sizes)
    dev_a = torch.empty(n, dtype=torch.uint8, device=device)
    dev_b = torch.empty(n, dtype=torch.uint8, device=device)
    host = {
        "pinned": (
            torch.ones(n, dtype=torch.uint8).pin_memory(),
            torch.empty(n, dtype=torch.uint8).pin_memory(),
        ),
        "pageable": (torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)),
    }
    h2d_stream, d2h_stream = torch.cuda.Stream(device), torch.cuda.Stream(device)
    out = []
    for size in sizes:
        inner = inner_repeats(size)
        for kind, (h_src, h_dst) in host.items():
            src, dst, d = h_src[:size], h_dst[:size], dev_a[:size]
            t = median_cuda_seconds(functools.partial(d.copy_, src, non_blocking=True),
                                    warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)  # fmt: skip
            out.append(Measurement("host->device", kind, size, size, 1, t))
            t = median_cuda_seconds(functools.partial(dst.copy_, d, non_blocking=True),
                                    warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)  # fmt: skip
            out.append(Measurement("device->host", kind, size, size, 1, t))
        src, dst = host["pinned"][0][:size], host["pinned"][1][:size]
        up, down = dev_a[:size], dev_b[:size]

        def both_ways(src: torch.Tensor = src, dst: torch.Tensor = dst, up: torch.Tensor = up,
                      down: torch.Tensor = down) -> None:  # fmt: skip
            main = torch.cuda.current_stream(device)
            h2d_stream.wait_stream(main)
            d2h_stream.wait_stream(main)
            with torch.cuda.stream(h2d_stream):
                up.copy_(src, non_blocking=True)
            with torch.cuda.stream(d2h_stream):
                dst.copy_(down, non_blocking=True)
            main.wait_stream(h2d_stream)
            main.wait_stream(d2h_stream)

        t = median_cuda_seconds(both_ways, warmup=cfg.warmup, repeats=cfg.repeats, inner=inner)
        out.append(Measurement("host<->device", "pinned both ways", size, 2 * size, 2, t))
        progress.point()
    return out
