"""How many of sparse attention's disk page reads a better replacement of the page store could save.

Records, for one sparse run of ``benchmarks/test_sparse.py``'s scene (the demo model, most KV on disk, policy
``lru``), the disk pages each layer-step's selection places in its kept layer (:meth:`KeptLayer.place`), then
replays every layer's sequence of selections through a page store of the same capacity under other replacement
rules, counting the misses (pages read from disk) over the second half of the steps, as the policy benchmark does:

    lru     evict the page attended longest ago (what :class:`~tierkv.attention.kept.KeptLayer` does)
    opt     Belady's: evict the page whose next selection is farthest (clairvoyant: the bound on any rule)
    2q      a page selected again after a gap, or read again after an eviction, is evicted after the others
    lrfu-H  evict the page of least recency-weighted frequency (selections halved every H steps)

    TIERKV_BENCH_SPARSE_CONTEXT=16384 python benchmarks/page_store_replacement.py 768 1536
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import test_sparse  # noqa: E402  (the scene: model, prompt, budgets)

from tierkv.attention import kept  # noqa: E402

Selections = list[list[int]]  # per layer-step, the disk pages placed in the kept layer
Chooser = Callable[[list[int], int], int]  # (candidates, step) -> the page to evict


def record(tokens: int) -> tuple[list[tuple[int, Selections]], float]:
    """Per kept layer, its capacity and its selections over a sparse run; the run's off-device KiB per step."""
    layers: dict[int, tuple[int, Selections]] = {}
    place = kept.KeptLayer.place

    def recording(self: kept.KeptLayer, ids: np.ndarray, columns: np.ndarray, tail: np.ndarray,
                  step: int) -> kept.Placed:  # fmt: skip
        layers.setdefault(id(self), (self.capacity, []))[1].append(ids[0][~tail[0]].tolist())
        return place(self, ids, columns, tail, step)

    kept.KeptLayer.place = recording  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(dir=test_sparse._directory()) as folder:
            decoder = test_sparse.Decoder(Path(folder), "lru")
            try:
                times: list[float] = []
                off: list[int] = []
                decoder.steps(test_sparse.DECODE, decoder.sparse(tokens), times, off, links=test_sparse.OFF_DEVICE)
            finally:
                decoder.cache.close()
    finally:
        kept.KeptLayer.place = place  # type: ignore[method-assign]
    late = off[test_sparse.DECODE // 2:]
    return list(layers.values()), sum(late) / len(late) / 2**10


def replay(capacity: int, steps: Selections, rule: str) -> int:
    """Misses over the second half of ``steps`` of a page store of ``capacity`` pages under ``rule``."""
    next_use: list[dict[int, int]] = [{} for _ in steps]
    later: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        next_use[t] = {page: later.get(page, len(steps)) for page in steps[t]}
        later.update(dict.fromkeys(steps[t], t))
    held: set[int] = set()
    used: dict[int, int] = {}
    again: set[int] = set()  # 2q: pages selected again after a gap, or read again after an eviction
    evicted: set[int] = set()
    weight: dict[int, float] = {}  # lrfu: recency-weighted selections as of used[page]
    half_life = float(rule.split("-")[1]) if rule.startswith("lrfu") else 1.0
    late_misses, previous = 0, set[int]()

    def rank(page: int, t: int) -> tuple[float, ...]:
        """The lowest ranked candidate is evicted."""
        if rule == "opt":
            return (-next_use[used[page]].get(page, len(steps)),)
        if rule == "2q":
            return (page in again, used[page])
        if rule == "lru":
            return (used[page],)
        return (weight[page] * 0.5 ** ((t - used[page]) / half_life),)

    for t, selection in enumerate(steps):
        chosen = set(selection)
        for page in selection:
            if page in held and page not in previous:
                again.add(page)
            if page in used:
                weight[page] = weight[page] * 0.5 ** ((t - used[page]) / half_life) + 1.0
            else:
                weight[page] = 1.0
            used[page] = t
        for page in selection:
            if page in held:
                continue
            late_misses += t >= len(steps) // 2
            if page in evicted:
                again.add(page)
            if len(held) >= capacity:
                candidates = [p for p in held if p not in chosen]
                if not candidates:
                    continue
                victim = min(candidates, key=lambda page, t=t: rank(page, t))  # type: ignore[misc]
                held.discard(victim)
                evicted.add(victim)
            held.add(page)
        previous = chosen
    return late_misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("selections", nargs="*", type=int, default=[768, 1536], metavar="TOKENS",
                        help="tokens the sparse run selects per layer, one run each (default: 768 1536); the context "
                             "is $TIERKV_BENCH_SPARSE_CONTEXT (default 16384)")
    args = parser.parse_args()
    rules = ("lru", "opt", "2q", "lrfu-1", "lrfu-4", "lrfu-16")
    print(f"context {test_sparse.CONTEXT}, device {test_sparse.GPU}: disk page misses over steps "
          f"{test_sparse.DECODE // 2}..{test_sparse.DECODE}, all layers")
    print(f"{'selection':>9} {'capacity':>8} {'lru KiB/step':>12} " + " ".join(f"{rule:>8}" for rule in rules))
    for tokens in args.selections:
        layers, kib = record(tokens)
        misses = [sum(replay(capacity, steps, rule) for capacity, steps in layers) for rule in rules]
        print(f"{tokens:>9} {layers[0][0]:>8} {kib:>12.0f} " + " ".join(f"{m:>8}" for m in misses))


if __name__ == "__main__":
    main()
