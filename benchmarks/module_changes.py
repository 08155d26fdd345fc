"""How often one exact-gather decode step changes tierkv module, per layer: a measure of how tangled the seams are.

    python benchmarks/module_changes.py [--layers 3] [--context 64] [--verbose]

A tiny random Llama (``--layers`` decoder layers) prefills ``--context`` tokens into a ``TieredCache`` and decodes
two tokens; the third decode step is traced with :func:`sys.setprofile`. Every Python call into a tierkv source
file, and every return into one, sets the "current" tierkv module; a change of it is counted (code of torch,
transformers and the standard library is transparent: it neither counts nor resets). Printed: the changes, the
changes per layer, and with ``--verbose`` the most frequent transitions. Deterministic for a given tree: it counts
calls, not time (the garbage collector is run before the step and held off during it).
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import transformers

import tierkv
from tierkv import TieredCache
from tierkv.hf import cache_keyword

PACKAGE = str(Path(tierkv.__file__).resolve().parent) + "/"


def _module(frame: FrameType | None) -> str | None:
    """The tierkv module (path relative to the package) that ``frame`` runs, or None outside tierkv."""
    if frame is None:
        return None
    path = frame.f_code.co_filename
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else None


def count_changes(step: Any) -> tuple[int, collections.Counter]:
    """Run ``step()`` under a profiler; return the module changes and a count of each ``(from, to)`` pair."""
    pairs: collections.Counter = collections.Counter()
    current: list[str | None] = [None]

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            module = _module(frame)
        elif event == "return":
            module = _module(frame.f_back)
        else:
            return
        if module is not None and module != current[0]:
            if current[0] is not None:
                pairs[(current[0], module)] += 1
            current[0] = module

    gc.collect()  # finalizers of objects dropped before (another cache's disk tier) would run inside the step
    gc.disable()
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        gc.enable()
    return sum(pairs.values()), pairs


def measure(layers: int = 3, context: int = 64) -> tuple[int, collections.Counter]:
    """Module changes of the third decode step after a ``context``-token prefill, and each ``(from, to)`` pair."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=4 * context)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(2, 128, (1, context))
    with torch.no_grad(), TieredCache(gpu_gb="64MB", cpu_gb="64MB", block_tokens=16, config=config) as cache:
        keyword = {cache_keyword(model): cache}
        token = model(ids, use_cache=True, **keyword).logits[:, -1:].argmax(-1)
        for _ in range(2):  # settle: staging sized, prefetch running
            token = model(token, use_cache=True, **keyword).logits[:, -1:].argmax(-1)
        return count_changes(lambda: model(token, use_cache=True, **keyword))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    changes, pairs = measure(args.layers, args.context)
    print(f"module changes in one exact-gather decode step of a {args.layers}-layer model: {changes} "
          f"({changes / args.layers:.1f} per layer)")
    if args.verbose:
        for (source, target), count in pairs.most_common(40):
            print(f"{count:5d}  {source} -> {target}")


if __name__ == "__main__":
    main()
