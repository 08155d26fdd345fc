"""What one sparse layer-step costs, piece by piece, with every block on the device (no disk latency).

    python benchmarks/sparse_layer_step.py [--context 32768] [--repeat 2000]

The demo model's passkey prompt (as ``benchmarks/test_sparse.py``: 128-token blocks, ~5% budget) is prefilled
into a cache whose device holds it all, a few sparse steps settle the kept blocks, then each piece of layer 1's
step is repeated ``--repeat`` times on the same state: the scoring, the sticky boost, the whole selection, the
fill of the staging buffer (kept blocks and the open tail), the attention with its per-block weights. A
developer's tool for the executor's hot path (it calls its internals): the times are this host's, compare runs
of two versions of the code made one after the other, not against other machines.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def timed(label: str, piece: Callable[[], object], repeat: int) -> None:
    piece()
    begun = time.perf_counter()
    for _ in range(repeat):
        piece()
    print(f"{label:44s} {(time.perf_counter() - begun) / repeat * 1e6:8.1f} us", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    os.environ["TIERKV_BENCH_SPARSE_CONTEXT"] = str(args.context)
    os.environ["TIERKV_BENCH_SPARSE_GPU"] = "512MiB"  # everything on the device
    sys.path.insert(0, str(Path(__file__).parent))
    import test_sparse as bench

    from tierkv.attention.lse import weighted_attention
    from tierkv.attention.sparse import SparseBudget

    with tempfile.TemporaryDirectory() as folder:
        decoder = bench.Decoder(Path(folder))
        tokens = bench.BUDGETS[0]
        with decoder.sparse(tokens)():
            for _ in range(4):
                decoder.step([], [])
            executor = decoder.cache.executors["sparse"]
            store, layer = executor.store, 1
            rows, summaries = store.table.rows[layer], executor.sparse_blocks.enable_summaries()
            layout = store.layouts[layer]
            stop, lo, hi = store.seq_length(layer), 1, rows.count - 1
            config = decoder.model.config
            groups = config.num_attention_heads // config.num_key_value_heads
            q = torch.randn(1, layout.kv_heads, groups, 1, layout.head_dim)  # [B, H_kv, G, 1, D]
            scaling, budget = layout.head_dim**-0.5, SparseBudget(tokens)
            score = executor._scores(layer, rows, lo, hi, q, summaries, scaling, None)
            columns = executor._select(layer, 0, stop, q, budget, summaries, scaling, None)
            staging = executor._staging(layer, 1, columns.shape[1])
            keys, values = staging[0], staging[1]  # [B, H_kv, K · block_tokens, D]
            print(f"demo model, {args.context:,} tokens, layer {layer}: {columns.shape[1]} of {rows.count} blocks")
            timed("scoring (summaries -> block scores)", lambda: executor._scores(
                layer, rows, lo, hi, q, summaries, scaling, None), args.repeat)
            timed("sticky boost", lambda: executor._with_sticky(layer, lo, hi, score), args.repeat)
            timed("whole selection", lambda: executor._select(
                layer, 0, stop, q, budget, summaries, scaling, None), args.repeat)
            timed("fill (kept blocks + the open tail)", lambda: executor._fill(layer, columns, staging), args.repeat)
            timed("attention + per-token weights", lambda: weighted_attention(
                q, keys, values, None, scaling, None), args.repeat)
            timed("policy update (attended)", lambda: executor.sparse_blocks.attended(layer, columns, None),
                  args.repeat)
        decoder.cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
