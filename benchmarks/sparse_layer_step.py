"""What one sparse layer-step costs, piece by piece, on the demo model at sparse's defaults.

    python benchmarks/sparse_layer_step.py [--context 16384] [--repeat 300] [--gpu 7MiB]

The demo model's passkey prompt (as ``benchmarks/test_sparse.py``: 128-token blocks, its device budget, the rest of
the KV on the host and disk) is prefilled, a few sparse steps (``tokens`` the benchmark's first budget, 16-token
pages, the default rest copy) settle the kept pages, then the arguments of layer 1's next calls are recorded and
each piece is repeated ``--repeat`` times on that state: the whole layer-step (``attend``), the selection (with
its scoring), the scoring alone, the rest copy's attention. A developer's tool for the executor's hot path (it
calls its internals): the times are this host's, compare runs of two versions of the code made one after the
other, not against other machines.
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
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--gpu", default="7MiB", help="the device budget (512MiB: every block on the device)")
    args = parser.parse_args()
    os.environ["TIERKV_BENCH_SPARSE_CONTEXT"] = str(args.context)
    os.environ["TIERKV_BENCH_SPARSE_GPU"] = args.gpu
    sys.path.insert(0, str(Path(__file__).parent))
    import test_sparse as bench

    from tierkv.attention.sparse import SparseAttention
    from tierkv.attention.sparse_rest import RestAttention
    from tierkv.staging import DEFAULT_REST_BITS

    layer = 1
    recorded: dict[str, tuple] = {}

    def recording(name: str, method: Callable) -> Callable:
        def wrapper(instance, *call_args):
            if call_args[0] == layer or getattr(call_args[0], "layer", None) == layer:
                recorded[name] = call_args
            return method(instance, *call_args)
        return wrapper

    with tempfile.TemporaryDirectory() as folder:
        decoder = bench.Decoder(Path(folder))
        with decoder.sparse(bench.BUDGETS[0], rest_bits=DEFAULT_REST_BITS)():
            for _ in range(4):
                decoder.step([], [])
            executor = decoder.cache.executors["sparse"]
            # (owner class, method, the object whose method is timed)
            pieces = {"attend": (SparseAttention, executor), "_select": (SparseAttention, executor),
                      "_scores": (SparseAttention, executor), "from_copy": (RestAttention, executor.rest)}
            originals = {name: getattr(owner, name) for name, (owner, _) in pieces.items()}
            for name, (owner, _) in pieces.items():
                setattr(owner, name, recording(name, originals[name]))
            try:
                decoder.step([], [])
            finally:
                for name, (owner, _) in pieces.items():
                    setattr(owner, name, originals[name])
            print(f"demo model, {args.context:,} tokens, layer {layer}, blocks {decoder.cache.stats()['blocks']}")
            with torch.no_grad():
                for name, label in (("attend", "the whole layer-step (attend)"), ("_select", "  selection"),
                                    ("_scores", "    scoring"), ("from_copy", "  rest copy's attention")):
                    if name in recorded:
                        method = getattr(pieces[name][1], name)
                        timed(label, lambda method=method, name=name: method(*recorded[name]), args.repeat)
        decoder.cache.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
