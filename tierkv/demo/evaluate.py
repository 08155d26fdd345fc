"""Retrieval accuracy of a model over context lengths x needle depths (the RULER-style heat map).

Each trial is a real greedy decode through a ``transformers.Cache``: the prompt is prefilled in chunks
(so a 64K prompt never materialises a 64K x 64K score matrix) and the answer digits are generated one
token at a time. ``cache_factory`` lets the same harness measure any cache (DynamicCache by default, a
``TieredCache`` or a sparse mode later) against the same seeded haystacks.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierkv import safefs
from tierkv.demo.task import KINDS, Example, decode_answer, make_example
from tierkv.errors import InvalidConfigError
from tierkv.units import format_tokens, plural

DEFAULT_LENGTHS = (4096, 16384, 32768, 65536)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True, slots=True)
class Trial:
    """One haystack: where the needle was, what was expected and what the model said."""

    length: int
    depth: float
    sample: int
    answer: str
    output: str
    correct: bool


@dataclass(frozen=True, slots=True)
class EvalResult:
    """All trials of one run plus the settings that produced them."""

    kind: str
    seed: int
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int
    trials: tuple[Trial, ...]

    def accuracy(self, length: int | None = None, depth: float | None = None) -> float:
        """Fraction correct over the trials matching ``length`` and/or ``depth`` (None: all)."""
        hits = [
            t.correct
            for t in self.trials
            if (length is None or t.length == length) and (depth is None or t.depth == depth)
        ]
        return sum(hits) / len(hits) if hits else float("nan")

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "seed": self.seed,
            "lengths": list(self.lengths),
            "depths": list(self.depths),
            "samples": self.samples,
            "accuracy": {str(n): self.accuracy(n) for n in self.lengths},
            "accuracy_by_depth": {str(n): {str(d): self.accuracy(n, d) for d in self.depths} for n in self.lengths},
            "trials": [asdict(t) for t in self.trials],
        }


@torch.no_grad()
def greedy_generate(
    model,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    cache_factory: Callable[[], object] | None = None,
    cache_context: Callable[[object], contextlib.AbstractContextManager] | None = None,
    prefill_chunk_size: int = 2048,
    on_prefill: Callable[[int, int], None] | None = None,
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` through a fresh cache, prefilling ``prefill_chunk_size``
    tokens per forward. Only the last position's logits are computed (``logits_to_keep=1``).
    ``on_prefill(done, total)`` is told after each prefill chunk (a long prompt's prefill takes minutes).

    ``cache_context(cache)`` is entered around the forwards (e.g. ``lambda c: c.streaming(model)``); a cache
    with a ``close`` method is closed afterwards (a ``TieredCache`` frees its tiers and disk files).
    """
    from transformers import DynamicCache

    from tierkv.hf import cache_keyword

    if prefill_chunk_size < 1:
        raise InvalidConfigError(f"prefill_chunk_size must be >= 1, got {prefill_chunk_size}")
    device = next(model.parameters()).device
    cache = cache_factory() if cache_factory is not None else DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    ids = torch.tensor([list(prompt_ids)], device=device)  # [1, T]
    generated: list[int] = []
    try:
        with cache_context(cache) if cache_context is not None else contextlib.nullcontext():
            out: Any = None
            for start in range(0, ids.shape[1], prefill_chunk_size):
                # the keyword this transformers takes (`cache=` in newer 5.x, `past_key_values=` before)
                out = model(input_ids=ids[:, start : start + prefill_chunk_size], logits_to_keep=1,
                            **{keyword: cache})
                if on_prefill is not None:
                    on_prefill(min(start + prefill_chunk_size, ids.shape[1]), ids.shape[1])
            for _ in range(max_new_tokens):
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                if len(generated) == max_new_tokens:
                    break
                out = model(input_ids=torch.tensor([[token]], device=device), logits_to_keep=1, **{keyword: cache})
    finally:
        close = getattr(cache, "close", None)
        if callable(close):
            close()
    return generated


def trial_example(kind: str, seed: int, length: int, depth: float, sample: int) -> Example:
    """The haystack of one trial of :func:`evaluate`: the same for its arguments on every run and machine."""
    return make_example(random.Random(f"{kind}/{seed}/{length}/{depth}/{sample}"), length, depth, kind)


def evaluate(
    model,
    tokenizer,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 4,
    kind: str = "passkey",
    seed: int = 0,
    cache_factory: Callable[[], object] | None = None,
    cache_context: Callable[[object], contextlib.AbstractContextManager] | None = None,
    prefill_chunk_size: int = 2048,
    on_trial: Callable[[Trial], None] | None = None,
    on_prefill: Callable[[int, int], None] | None = None,
) -> EvalResult:
    """Greedy retrieval accuracy over ``samples`` seeded haystacks per (length, depth); ``on_trial`` is told
    of each finished trial, ``on_prefill`` of each prefill chunk (:func:`greedy_generate`).

    The haystack of (kind, seed, length, depth, sample) is the same on every run and every machine, so
    two cache modes evaluated with the same arguments see identical prompts.
    """
    if samples < 1:
        raise InvalidConfigError(f"samples must be >= 1, got {samples}")
    if kind not in KINDS:
        raise InvalidConfigError(f"unknown task kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not lengths or not depths:
        raise InvalidConfigError("give at least one length and one depth")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise InvalidConfigError(f"needle depths must be in [0, 1], got {d}")
    trials = []
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                example = trial_example(kind, seed, length, depth, sample)
                ids = greedy_generate(
                    model,
                    example.prompt_ids,
                    len(example.answer_ids),
                    cache_factory=cache_factory,
                    cache_context=cache_context,
                    prefill_chunk_size=prefill_chunk_size,
                    on_prefill=on_prefill,
                )
                output = decode_answer(tokenizer, ids)
                trial = Trial(length, depth, sample, example.answer, output, output == example.answer)
                trials.append(trial)
                if on_trial is not None:
                    on_trial(trial)
    return EvalResult(kind, seed, tuple(lengths), tuple(depths), samples, tuple(trials))


def plot_heatmap(result: EvalResult, path: str | Path) -> Path:
    """Write a depth x length accuracy heat map (PNG) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [[result.accuracy(n, d) for n in result.lengths] for d in result.depths]
    fig, ax = plt.subplots(figsize=(1.4 * len(result.lengths) + 2.5, 0.6 * len(result.depths) + 1.8))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(result.lengths)), [format_tokens(n) for n in result.lengths])
    ax.set_yticks(range(len(result.depths)), [f"{d:.0%}" for d in result.depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{result.kind} retrieval accuracy ({plural(result.samples, 'haystack')} per cell)")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=9)
    fig.colorbar(image, ax=ax, label="accuracy")
    fig.tight_layout()
    path = Path(path)
    os.close(safefs.open_user_directory(path.parent))  # created 0700 if missing
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    safefs.write_file(path, [png.getvalue()])  # 0600, a link planted there replaced, never written through
    return path
