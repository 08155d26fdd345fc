"""``tierkv eval``: retrieval accuracy of the demo model over context lengths and needle depths.

    tierkv eval --lengths 4K,16K,32K,64K --depths 0,0.25,0.5,0.75,1 --samples 4 --out results/

Prints a depth x length table, and with ``--out`` writes ``eval.json`` and ``heatmap.png`` there; ``--json
[PATH]`` writes the record to PATH or stdout (the table then goes to stderr).
``--cache tiered`` runs every trial through a ``TieredCache`` (all three tiers; ``--executor``) instead of
the in-memory ``DynamicCache``: exact attention must give the same table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tierkv.commands import (
    add_json_argument,
    checkpoint_folder,
    fractions,
    integer,
    json_to_stdout,
    size,
    token_list,
    tokens,
    write_json,
)
from tierkv.units import format_tokens, plural


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=token_list("--lengths"), default="4K,16K,32K,64K",
                        help="context lengths in tokens, e.g. 4K,1.5K,32768 (default: %(default)s)")
    parser.add_argument("--depths", type=fractions("--depths"), default="0,0.25,0.5,0.75,1",
                        help="needle depths in [0, 1] (default: %(default)s)")
    parser.add_argument("--samples", type=integer("--samples", 1), default=4,
                        help="seeded haystacks per cell (default: %(default)s)")
    parser.add_argument("--kind", default="passkey", choices=("passkey", "multikey"), help="task (default: passkey)")
    parser.add_argument("--seed", type=integer("--seed", 0), default=0, help="haystack seed (default: %(default)s)")
    parser.add_argument("--model", type=checkpoint_folder("--model"), default=None,
                        help="model folder (default: the packaged demo model)")
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=tokens("--prefill-chunk"), default=2048,
                        help="prefill tokens per forward (default: %(default)s)")
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "tiered"),
                        help="dynamic: full attention in memory (DynamicCache); tiered: TieredCache over three tiers")
    parser.add_argument("--executor", default="streaming", choices=("streaming", "gather"),
                        help="with --cache tiered: streaming attention or exact gather (default: %(default)s)")
    parser.add_argument("--chunk-tokens", type=tokens("--chunk-tokens"), default=4096,
                        help="with --executor streaming: tokens per attention chunk (default: %(default)s)")
    parser.add_argument("--gpu-gb", type=size("--gpu-gb"), default=None,
                        help="with --cache tiered: device budget, GB or a size (default: the executor's minimum + "
                             "1/8 of the longest prompt's KV)")
    parser.add_argument("--cpu-gb", type=size("--cpu-gb"), default=None,
                        help="with --cache tiered: host budget (default: 1/4 of that KV)")
    parser.add_argument("--disk-dir", default=None, help="with --cache tiered: disk tier folder (default: a temp dir)")
    parser.add_argument("--out", default=None, help="folder for eval.json and heatmap.png")
    add_json_argument(parser, "the result (every trial)")


def _cache_mode(args: argparse.Namespace, model, longest: int, tmp: str):
    """``(cache_factory, cache_context, record)`` for ``--cache``: None/None for the in-memory reference, or a
    fresh ``TieredCache`` per trial with budgets sized on the longest prompt (shorter ones keep more on the
    device)."""
    if args.cache == "dynamic":
        return None, None, {"mode": "dynamic"}
    import torch

    from tierkv import TieredCache

    kv = TieredCache.kv_bytes_per_token(model.config, torch.float32) * (longest + 8)
    if args.gpu_gb is not None:
        gpu = args.gpu_gb
    elif args.executor == "streaming":
        gpu = TieredCache.min_streaming_device_bytes(model.config, chunk_tokens=args.chunk_tokens) + kv // 8
    else:
        gpu = TieredCache.min_device_bytes(model.config, longest + 8) + kv // 8
    cpu = args.cpu_gb if args.cpu_gb is not None else max(kv // 4, 2**20)
    disk = args.disk_dir or tmp

    def factory() -> TieredCache:
        return TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=disk, config=model.config)

    streaming = args.executor == "streaming"
    context = (lambda cache: cache.streaming(model, chunk_tokens=args.chunk_tokens)) if streaming else None
    return factory, context, {"mode": "tiered", "executor": args.executor, "gpu_bytes": gpu, "cpu_bytes": cpu}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tierkv.demo.evaluate import evaluate, plot_heatmap
    from tierkv.demo.model import load_demo_model

    lengths, depths = args.lengths, args.depths
    console = Console(stderr=json_to_stdout(args), highlight=False)
    status = Console(stderr=True, highlight=False)  # per-trial progress: never mixed into the results
    model, tokenizer = load_demo_model(device=args.device, path=args.model)
    total = len(lengths) * len(depths) * args.samples
    done = 0
    start = time.perf_counter()

    def progress(trial) -> None:
        nonlocal done
        done += 1
        mark = "ok" if trial.correct else f"got {trial.output!r}"
        status.log(
            f"[{done}/{total}] {format_tokens(trial.length)} depth {trial.depth:.2f} "
            f"#{trial.sample}: {trial.answer} {mark}"
        )

    with tempfile.TemporaryDirectory(prefix="tierkv-eval-") as tmp:
        factory, context, cache_record = _cache_mode(args, model, max(lengths), tmp)
        result = evaluate(
            model,
            tokenizer,
            lengths=lengths,
            depths=depths,
            samples=args.samples,
            kind=args.kind,
            seed=args.seed,
            cache_factory=factory,
            cache_context=context,
            prefill_chunk_size=args.prefill_chunk,
            on_trial=progress,
        )
    record = result.to_dict() | {"wall_time_s": round(time.perf_counter() - start, 1), "device": args.device,
                                 "cache": cache_record}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        heatmap, record_path = plot_heatmap(result, out / "heatmap.png"), write_json(record, str(out / "eval.json"))
        status.log(f"wrote {heatmap} and {record_path}")
    if args.json:
        written = write_json(record, args.json)
        if written:
            status.log(f"wrote {written}")
    table = Table(title=f"{args.kind} accuracy, greedy, {plural(args.samples, 'haystack')} per cell")
    table.add_column("depth", justify="right")
    for n in lengths:
        table.add_column(format_tokens(n), justify="right")
    for d in depths:
        table.add_row(f"{d:.0%}", *(f"{result.accuracy(n, d):.0%}" for n in lengths))
    table.add_row("all", *(f"[bold]{result.accuracy(n):.0%}[/bold]" for n in lengths))
    console.print(table)
    return 0
