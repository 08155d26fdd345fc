"""``tierkv demo``: decode a long context through device, host and disk tiers, and check the answer.

By default it uses the shipped demo model on a passkey-retrieval haystack; the device budget is a small
fraction of the KV, so all three tiers hold blocks. It prefills in chunks (progress bar), decodes the
answer greedily showing live tier occupancy and traffic, then compares with an in-memory ``DynamicCache``
run. Without the shipped weights (or with ``--random-model``) a tiny random Llama shows exactness only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.live import Live
from rich.progress import Progress
from rich.table import Table

from tierkv.config import parse_size
from tierkv.errors import InvalidConfigError, TierKVError

console = Console()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", default="32K", help="haystack length in tokens, e.g. 8K, 32768 (default 32K)")
    parser.add_argument("--gpu-gb", default=None, help="device budget; default: 1/8 of the KV (plus staging)")
    parser.add_argument("--executor", choices=("streaming", "gather"), default="streaming",
                        help="streaming: chunked exact attention, device holds two chunks (default); "
                             "gather: whole layers assembled on the device")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="chunk length of the streaming executor")
    parser.add_argument("--cpu-gb", default=None, help="host budget; default: 1/4 of the KV")
    parser.add_argument("--disk-dir", default=None, help="disk tier directory (default: a temporary directory)")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the answer's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depth", type=float, default=0.3, help="needle depth in the haystack, 0..1")
    parser.add_argument("--model", default=None, help="a local HF checkpoint folder instead of the demo model")
    parser.add_argument("--prompt-file", default=None, help="prompt text for --model")
    parser.add_argument("--random-model", action="store_true", help="a tiny random Llama (exactness only)")
    parser.add_argument("--no-reference", action="store_true", help="skip the in-memory DynamicCache check")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    from tierkv.planner import parse_tokens

    context = parse_tokens(str(args.context), name="--context")
    model, prompt, expected, decode = _load(args, context)
    kv_bytes = _kv_bytes(model, len(prompt) + decode)
    gpu = parse_size(args.gpu_gb, name="--gpu-gb") if args.gpu_gb else None
    cpu = parse_size(args.cpu_gb, name="--cpu-gb") if args.cpu_gb else max(kv_bytes // 4, 2**20)
    if gpu is None:
        from tierkv import TieredCache

        if args.executor == "streaming":
            floor = TieredCache.min_streaming_device_bytes(model.config, block_tokens=args.block_tokens,
                                                           chunk_tokens=args.chunk_tokens)
        else:
            floor = TieredCache.min_device_bytes(model.config, len(prompt) + decode, block_tokens=args.block_tokens)
        gpu = floor + kv_bytes // 8
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        disk_dir = args.disk_dir or tmp
        try:
            result = _decode(args, model, prompt, decode, gpu, cpu, disk_dir)
        except TierKVError as exc:
            console.print(f"[red]tierkv error:[/red] {exc}")
            return 2
    answer_text = result["answer_text"]
    reference = None if args.no_reference else _reference(model, prompt, decode, args.prefill_chunk)
    summary = {
        "context": len(prompt),
        "kv_bytes": kv_bytes,
        "budgets": {"device": gpu, "host": cpu},
        "executor": args.executor,
        "expected": expected,
        "answer": answer_text,
        "match": expected is not None and answer_text.replace(" ", "").startswith(expected),
        "tokens_match_reference": None if reference is None else reference == result["tokens"],
        **{k: result[k] for k in ("bytes_resident", "bytes_moved", "blocks", "decode_tokens_per_s",
                                  "prefill_tokens_per_s", "prefetch_stall_s", "disk_engine")},
    }
    _print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    ok = summary["tokens_match_reference"] is not False and (expected is None or summary["match"])
    return 0 if ok else 1


def _load(args: argparse.Namespace, context: int):
    """(model, prompt ids, expected answer or None, tokens to decode)."""
    torch.manual_seed(args.seed)
    if args.model:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not args.prompt_file:
            raise InvalidConfigError("--model needs --prompt-file with the prompt text to decode from.")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        prompt = tokenizer(Path(args.prompt_file).read_text())["input_ids"]
        return _with_decoder(model, tokenizer), prompt, None, args.max_new_tokens or 32
    if not args.random_model:
        try:
            from tierkv.demo.model import load_demo_model
            from tierkv.demo.task import make_example

            model, tokenizer = load_demo_model()
        except (ImportError, TierKVError) as exc:  # a checkout without the trained demo model
            console.print(f"[yellow]{exc}[/yellow]\nFalling back to a random tiny Llama (exactness only).")
        else:
            example = make_example(random.Random(args.seed), context, args.depth)
            decode = args.max_new_tokens or len(example.answer_ids)
            return _with_decoder(model, tokenizer), list(example.prompt_ids), example.answer, decode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context + 64)
    model = LlamaForCausalLM(config).eval()
    model.decode_tokens = lambda ids: " ".join(map(str, ids))
    prompt = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(args.seed))
    return model, prompt.tolist(), None, args.max_new_tokens or 16


def _with_decoder(model, tokenizer):
    model.decode_tokens = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return model


def _kv_bytes(model, tokens: int) -> int:
    from tierkv import TieredCache

    return TieredCache.kv_bytes_per_token(model.config, torch.float32) * tokens


@dataclass
class GreedyRun:
    tokens: list[int]
    prefill_s: float
    decode_s: float


def greedy(model, prompt: list[int], decode: int, cache, chunk: int,
           on_prefill: Callable[[int], None] = lambda n: None,
           on_token: Callable[[list[int], float], None] = lambda tokens, elapsed: None) -> GreedyRun:
    """Prefill ``prompt`` in chunks, then decode ``decode`` tokens greedily through ``cache``."""
    ids = torch.tensor([prompt])
    started = time.perf_counter()
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], past_key_values=cache, logits_to_keep=1)
        on_prefill(min(chunk, ids.shape[1] - start))
    prefill_s = time.perf_counter() - started
    tokens: list[int] = []
    started = time.perf_counter()
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        on_token(tokens, time.perf_counter() - started)
        if len(tokens) == decode:
            break
        out = model(input_ids=torch.tensor([tokens[-1:]]), past_key_values=cache, logits_to_keep=1)
    return GreedyRun(tokens, prefill_s, time.perf_counter() - started)


def _decode(args, model, prompt: list[int], decode: int, gpu: int, cpu: int, disk_dir: str) -> dict:
    from tierkv import TieredCache

    progress = Progress(console=console)
    task = progress.add_task("prefill", total=len(prompt))
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=disk_dir, block_tokens=args.block_tokens,
                     config=model.config) as cache, torch.inference_mode(), _executor(args, cache, model), \
            Live(Group(progress, _live_table(cache, [], 0.0)), console=console, refresh_per_second=8) as live:

        def show(tokens: list[int], elapsed: float) -> None:
            live.update(Group(progress, _live_table(cache, tokens, elapsed)))

        run = greedy(model, prompt, decode, cache, args.prefill_chunk,
                     on_prefill=lambda n: (progress.update(task, advance=n), show([], 0.0)), on_token=show)
        stats = cache.stats()
    return {
        "tokens": run.tokens,
        "answer_text": model.decode_tokens(run.tokens),
        "bytes_resident": stats["bytes_resident"],
        "bytes_moved": stats["bytes_moved"],
        "blocks": stats["blocks"],
        "prefetch_stall_s": stats["prefetch_stall_s"],
        "disk_engine": stats["disk_engine"],
        "decode_tokens_per_s": len(run.tokens) / run.decode_s if run.decode_s > 0 else float("inf"),
        "prefill_tokens_per_s": len(prompt) / run.prefill_s,
    }


def _executor(args: argparse.Namespace, cache, model):
    """The attention executor's context: streaming attention, or nothing (exact gather is the default path)."""
    if args.executor == "streaming":
        return cache.streaming(model, chunk_tokens=args.chunk_tokens)
    return contextlib.nullcontext()


def _live_table(cache, tokens: list[int], elapsed: float) -> Table:
    stats = cache.stats()
    table = Table(title=f"decoding: {len(tokens)} tokens, {len(tokens) / elapsed if elapsed else 0:.2f} tok/s")
    table.add_column("tier")
    table.add_column("blocks", justify="right")
    table.add_column("KV resident", justify="right")
    for tier, nbytes in stats["bytes_resident"].items():
        table.add_row(tier, str(stats["blocks"][tier]), _mb(nbytes))
    moved = ", ".join(f"{link} {_mb(n)}" for link, n in stats["bytes_moved"].items() if n)
    table.caption = f"moved: {moved}; prefetch stall {stats['prefetch_stall_s']:.3f} s"
    return table


def _reference(model, prompt: list[int], decode: int, chunk: int) -> list[int]:
    """Greedy tokens with transformers' in-memory DynamicCache, prefilled in the same chunks."""
    from transformers import DynamicCache

    with torch.inference_mode():
        return greedy(model, prompt, decode, DynamicCache(), chunk).tokens


def _print_summary(summary: dict) -> None:
    table = Table(title="tierkv demo")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("context", f"{summary['context']:,} tokens")
    table.add_row("KV size", _mb(summary["kv_bytes"]))
    table.add_row("budgets", f"device {_mb(summary['budgets']['device'])}, host {_mb(summary['budgets']['host'])}")
    table.add_row("executor", summary["executor"])
    for tier, nbytes in summary["bytes_resident"].items():
        table.add_row(f"resident on {tier}", f"{_mb(nbytes)} ({summary['blocks'][tier]} blocks)")
    for link, nbytes in summary["bytes_moved"].items():
        if nbytes:
            table.add_row(f"moved {link}", _mb(nbytes))
    table.add_row("prefill", f"{summary['prefill_tokens_per_s']:,.0f} tok/s")
    table.add_row("decode", f"{summary['decode_tokens_per_s']:.2f} tok/s")
    table.add_row("prefetch stall", f"{summary['prefetch_stall_s']:.3f} s")
    table.add_row("disk engine", str(summary["disk_engine"]))
    if summary["expected"] is not None:
        table.add_row("expected passkey", summary["expected"])
        table.add_row("answer", summary["answer"])
        table.add_row("match", "[green]yes[/green]" if summary["match"] else "[red]no[/red]")
    else:
        table.add_row("answer", summary["answer"][:60])
    reference = summary["tokens_match_reference"]
    table.add_row("tokens == DynamicCache", "skipped" if reference is None else
                  ("[green]yes[/green]" if reference else "[red]no[/red]"))
    console.print(table)


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"
