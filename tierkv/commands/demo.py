"""``tierkv demo``: decode a long context through device, host and disk tiers, and check the answer.

By default it uses the shipped demo model on a passkey-retrieval haystack; the device budget is a small
fraction of the KV, so all three tiers hold blocks. ``--model smollm2`` (or ``gemma3``) asks a real pretrained
model (SmolLM2-135M-Instruct, Gemma 3 270M: :mod:`tierkv.models`) for a fact hidden in a long real document
(the Python Language Reference that ships with CPython, :mod:`tierkv.quality.tasks`). It prefills in chunks,
decodes greedily (16 tokens by default, so the decode rate is measured over real decode steps), then compares
the tokens with an in-memory ``DynamicCache`` run. Without the shipped weights (or with ``--random-model``) a
tiny random Llama shows exactness only. Progress and tier occupancy show live on stderr when it is a terminal;
the result table goes to stdout (to stderr with ``--json -``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
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

from tierkv.commands import (
    add_json_argument,
    existing_file,
    integer,
    json_to_stdout,
    model_or_folder,
    number,
    size,
    tokens,
    write_json,
)
from tierkv.errors import InvalidConfigError
from tierkv.staging import REST_BITS
from tierkv.units import format_bytes, format_tokens, plural

DEFAULT_CONTEXT = 32768
REAL_MODEL_DEFAULT_CONTEXT = 4096  # a 4K prefill of a 135M-270M model takes 15-30 s on two CPU cores
BLOCK_TOKENS = 64  # exact executors: blocks large enough for efficient reads
SPARSE_BLOCK_TOKENS = 8  # sparse: blocks are selected whole, and 8-token ones select far better (docs/quality.md)
MIN_DECODE = 16  # default decode length: enough steps for a decode rate that is not one token's noise
FEW_TOKENS_PER_WORD = 0.25  # a real tokenizer gives >= ~1 token per word; far fewer means the wrong one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=tokens("--context", minimum=64), default=None,
                        help="haystack length in tokens, e.g. 8K, 1.5K, 32768 (default 32K; 4K with a real --model)")
    parser.add_argument("--gpu-gb", type=size("--gpu-gb"), default=None,
                        help="device budget, GB or a size ('8MiB'); default: 1/8 of the KV plus the executor's minimum")
    parser.add_argument("--executor", choices=("streaming", "gather", "sparse"), default="streaming",
                        help="streaming: chunked exact attention, device holds two chunks (default); "
                             "gather: whole layers assembled on the device; sparse: decode steps attend only the "
                             "top blocks (approximate; --sparse-tokens)")
    parser.add_argument("--sparse-tokens", type=_sparse_budget, default=0.1,
                        help="with --executor sparse: tokens attended per layer, a count (2048, 2K) or a fraction "
                             "of the context (0.1, the default)")
    parser.add_argument("--sparse-rest-bits", type=int, choices=REST_BITS, default=0,
                        help="with --executor sparse: attend the blocks not read from a copy of this many bits on the "
                             "device (default 0: not at all)")
    parser.add_argument("--chunk-tokens", type=tokens("--chunk-tokens"), default=1024,
                        help="chunk length of the streaming executor (default 1024)")
    parser.add_argument("--cpu-gb", type=size("--cpu-gb"), default=None, help="host budget; default: 1/4 of the KV")
    parser.add_argument("--disk-dir", default=None, help="disk tier directory (default: a temporary directory)")
    parser.add_argument("--block-tokens", type=integer("--block-tokens", 1), default=None,
                        help=f"tokens per block (default {BLOCK_TOKENS}; {SPARSE_BLOCK_TOKENS} with --executor sparse)")
    parser.add_argument("--prefill-chunk", type=tokens("--prefill-chunk"), default=1024,
                        help="prefill tokens per forward (default 1024)")
    parser.add_argument("--max-new-tokens", type=integer("--max-new-tokens", 1), default=None,
                        help=f"tokens to decode (default: {MIN_DECODE}, or the answer's length if longer; 32 "
                             "with --model)")
    parser.add_argument("--seed", type=integer("--seed", 0), default=0)
    parser.add_argument("--depth", type=number("--depth", 0.0, 1.0), default=0.3,
                        help="needle depth in the haystack, 0..1 (default 0.3)")
    parser.add_argument("--model", type=model_or_folder("--model"), default=None,
                        help="a named model (demo, smollm2, gemma3: see tierkv.models) or a local HF checkpoint folder "
                             "(needs --prompt-file) instead of the demo model")
    parser.add_argument("--prompt-file", type=existing_file("--prompt-file"), default=None,
                        help="prompt text for --model")
    parser.add_argument("--random-model", action="store_true", help="a tiny random Llama (exactness only)")
    parser.add_argument("--no-reference", action="store_true", help="skip the in-memory DynamicCache check")
    add_json_argument(parser, "the results")


def _check_combination(args: argparse.Namespace) -> None:
    """Options that only make sense together, checked before anything is loaded."""
    folder = isinstance(args.model, Path)
    if folder and not args.prompt_file:
        raise InvalidConfigError("--model needs --prompt-file with the prompt text to decode from.")
    if args.prompt_file and not folder:
        raise InvalidConfigError("--prompt-file needs --model with a checkpoint folder (the named models build "
                                 "their own haystack).")
    trained = _trained_context(args.model) if isinstance(args.model, str) else None
    if trained is not None and args.context is not None and args.context > trained:
        raise InvalidConfigError(f"--context {args.context}: {args.model} was trained for {trained} tokens; give "
                                 f"--context {format_tokens(trained)} or less.")
    if args.model and args.random_model:
        raise InvalidConfigError("--model and --random-model exclude each other; give one.")
    if args.sparse_rest_bits and args.executor != "sparse":
        raise InvalidConfigError("--sparse-rest-bits needs --executor sparse (exact attention reads every block).")


def run(args: argparse.Namespace) -> int:
    _check_combination(args)
    if args.block_tokens is None:
        args.block_tokens = SPARSE_BLOCK_TOKENS if args.executor == "sparse" else BLOCK_TOKENS
    out = Console(stderr=json_to_stdout(args), highlight=False)
    status = Console(stderr=True, highlight=False)
    model, prompt, expected, decode = _load(args, status)
    kv_bytes = _kv_bytes(model, len(prompt) + decode)
    gpu, cpu = args.gpu_gb, args.cpu_gb if args.cpu_gb is not None else max(kv_bytes // 4, 2**20)
    if gpu is None:
        from tierkv import TieredCache
        from tierkv.planner import kv_summary_bytes

        if args.executor == "gather":
            floor = TieredCache.min_device_bytes(model.config, len(prompt) + decode, block_tokens=args.block_tokens)
        else:
            floor = TieredCache.min_streaming_device_bytes(model.config, block_tokens=args.block_tokens,
                                                           chunk_tokens=args.chunk_tokens)
        if args.executor == "sparse":  # key summaries (min, max, mean: 1.5/block_tokens of the KV), the selection
            floor += kv_summary_bytes(kv_bytes, args.block_tokens) + \
                2 * _sparse_selection_bytes(args, model, len(prompt)) + \
                TieredCache.rest_copy_bytes(model.config, len(prompt) + decode, args.sparse_rest_bits, torch.float32)
        gpu = floor + kv_bytes // 8
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        result = _decode(args, model, prompt, decode, gpu, cpu, args.disk_dir or tmp, status)
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
        **{k: result[k] for k in ("bytes_resident", "bytes_moved", "blocks", "decode_tokens", "decode_steps",
                                  "decode_tokens_per_s", "prefill_tokens_per_s", "prefetch_stall_s", "disk_engine",
                                  "sparse")},
    }
    _print_summary(out, summary)
    if args.json:
        written = write_json(summary, args.json)
        if written:
            status.print(f"wrote {written}")
    exact = args.executor != "sparse"  # sparse attention is approximate: only its answer must be right
    ok = (not exact or summary["tokens_match_reference"] is not False) and (expected is None or summary["match"])
    return 0 if ok else 1


def _load(args: argparse.Namespace, status: Console):
    """(model, prompt ids, expected answer or None, tokens to decode)."""
    torch.manual_seed(args.seed)
    if isinstance(args.model, Path):
        model, tokenizer = _load_checkpoint(args.model)
        prompt = _tokenize_prompt(tokenizer, args.prompt_file, status)
        return _with_decoder(model, tokenizer), prompt, None, args.max_new_tokens or 32
    if isinstance(args.model, str) and args.model != "demo":
        return _real_model_question(args, status)
    if not args.random_model:
        from tierkv.demo.model import DemoWeightsMissingError, load_demo_model
        from tierkv.demo.task import make_example

        try:
            model, tokenizer = load_demo_model()
        except DemoWeightsMissingError as exc:  # a checkout without the trained demo model
            status.print(f"[yellow]{exc}[/yellow]\nFalling back to a random tiny Llama (exactness only).")
        else:
            example = make_example(random.Random(args.seed), args.context or DEFAULT_CONTEXT, args.depth)
            decode = args.max_new_tokens or max(MIN_DECODE, len(example.answer_ids))
            return _with_decoder(model, tokenizer), list(example.prompt_ids), example.answer, decode
    from transformers import LlamaConfig, LlamaForCausalLM

    context = args.context or DEFAULT_CONTEXT
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context + 64)
    model = LlamaForCausalLM(config).eval()
    model.decode_tokens = lambda ids: " ".join(map(str, ids))
    prompt = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(args.seed))
    return model, prompt.tolist(), None, args.max_new_tokens or MIN_DECODE


def _trained_context(name: str) -> int:
    from tierkv import models

    return models.spec(name).context


def _real_model_question(args: argparse.Namespace, status: Console):
    """A named real model asked for a fact placed at ``--depth`` of a real document of ``--context`` tokens."""
    from tierkv import models
    from tierkv.quality.tasks import TextTaskWriter

    status.print(f"loading {models.spec(args.model).description} (the first load dequantises the GGUF, "
                 "30-70 s)")
    model, tokenizer = models.load(args.model)
    prompt = TextTaskWriter(tokenizer).needle(args.context or REAL_MODEL_DEFAULT_CONTEXT, args.depth, 0, args.seed)
    status.print(f"question: {tokenizer.decode(prompt.question_ids, skip_special_tokens=True)!r}")
    decode = args.max_new_tokens or max(MIN_DECODE // 2, prompt.answer_tokens)
    return _with_decoder(model, tokenizer), list(prompt.ids), prompt.answer, decode


def _load_checkpoint(folder: Path):
    """(model, tokenizer) of a local checkpoint; transformers' own errors become one line naming the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
    except (OSError, ValueError, ImportError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidConfigError(f"--model {str(folder)!r}: transformers cannot load it: {first}") from exc
    return model, tokenizer


def _tokenize_prompt(tokenizer, path: Path, status: Console) -> list[int]:
    """The prompt's ids, with a warning when the tokenizer makes far fewer tokens than the text has words:
    a checkpoint whose tokenizer files transformers maps to the wrong class (seen with Qwen2) silently
    turns a long prompt into a handful of ids."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(f"--prompt-file {str(path)!r} is not UTF-8 text ({exc.reason}).") from None
    prompt = list(tokenizer(text)["input_ids"])
    if not prompt:
        raise InvalidConfigError(f"--prompt-file {str(path)!r} tokenizes to no tokens; give a file with text.")
    words = len(text.split())
    if len(prompt) < FEW_TOKENS_PER_WORD * words:
        status.print(
            f"[yellow]warning:[/yellow] --prompt-file has {words:,} words but {type(tokenizer).__name__} made "
            f"{plural(len(prompt), 'token')} of it; the checkpoint's tokenizer files may not fit this transformers "
            f"version. The demo decodes from those {plural(len(prompt), 'token')}.")
    return prompt


def _with_decoder(model, tokenizer):
    model.decode_tokens = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return model


def _kv_bytes(model, n_tokens: int) -> int:
    """What the tiers hold at the end (sliding-window layers: their window), which the budgets are shares of."""
    from tierkv import TieredCache

    return TieredCache.kv_bytes_held(model.config, n_tokens, torch.float32)


@dataclass
class GreedyRun:
    """Tokens of a greedy run; ``decode_s`` covers the ``len(tokens) - 1`` decode steps after the prefill
    (the first token comes from the prefill's logits)."""

    tokens: list[int]
    prefill_s: float
    decode_s: float


def greedy(model, prompt: list[int], decode: int, cache, chunk: int,
           on_prefill: Callable[[int], None] = lambda n: None,
           on_token: Callable[[list[int], float], None] = lambda tokens, elapsed: None) -> GreedyRun:
    """Prefill ``prompt`` in chunks, then decode ``decode`` tokens greedily through ``cache``.

    The cache is passed by the keyword the installed transformers takes (:func:`tierkv.hf.cache_keyword`).
    """
    from tierkv.hf import cache_keyword

    keyword = cache_keyword(model)
    ids = torch.tensor([prompt])  # [1, T]
    started = time.perf_counter()
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], logits_to_keep=1, **{keyword: cache})
        on_prefill(min(chunk, ids.shape[1] - start))
    prefill_s = time.perf_counter() - started
    tokens: list[int] = []
    started = time.perf_counter()
    while True:
        tokens.append(int(out.logits[0, -1].argmax()))
        on_token(tokens, time.perf_counter() - started)
        if len(tokens) == decode:
            break
        out = model(input_ids=torch.tensor([tokens[-1:]]), logits_to_keep=1, **{keyword: cache})
    return GreedyRun(tokens, prefill_s, time.perf_counter() - started)


def _decode(args, model, prompt: list[int], decode: int, gpu: int, cpu: int, disk_dir: str,
            status: Console) -> dict:
    """The tiered run, with a live panel on stderr when it is a terminal (nothing when it is piped)."""
    from tierkv import TieredCache

    live_view = status.is_terminal
    progress = Progress(console=status, transient=True)
    task = progress.add_task("prefill", total=len(prompt))
    with TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=disk_dir, block_tokens=args.block_tokens,
                     config=model.config) as cache, torch.inference_mode(), _executor(args, cache, model), \
            (Live(Group(progress, _live_table(cache, [], 0.0, decode)), console=status, refresh_per_second=8,
                  transient=True) if live_view else contextlib.nullcontext()) as live:

        def show(tokens: list[int], elapsed: float) -> None:
            if live is not None:
                live.update(Group(progress, _live_table(cache, tokens, elapsed, decode)))

        def prefilled(n: int) -> None:
            progress.update(task, advance=n)
            show([], 0.0)

        run = greedy(model, prompt, decode, cache, args.prefill_chunk, on_prefill=prefilled, on_token=show)
        stats = cache.stats()
    steps = len(run.tokens) - 1
    return {
        "tokens": run.tokens,
        "answer_text": model.decode_tokens(run.tokens),
        "bytes_resident": stats["bytes_resident"],
        "bytes_moved": stats["bytes_moved"],
        "blocks": stats["blocks"],
        "prefetch_stall_s": stats["prefetch_stall_s"],
        "disk_engine": stats["disk_engine"],
        "sparse": stats.get("sparse"),  # what sparse decode steps read (None with the exact executors)
        "decode_tokens": len(run.tokens),
        "decode_steps": steps,
        "decode_tokens_per_s": steps / run.decode_s if steps and run.decode_s > 0 else None,
        "prefill_tokens_per_s": len(prompt) / run.prefill_s,
    }


def _executor(args: argparse.Namespace, cache, model):
    """The attention executor's context: streaming or sparse attention, or nothing (exact gather is the default
    path)."""
    if args.executor == "streaming":
        return cache.streaming(model, chunk_tokens=args.chunk_tokens)
    if args.executor == "sparse":
        return cache.sparse(model, tokens=args.sparse_tokens, chunk_tokens=args.chunk_tokens,
                            rest_bits=args.sparse_rest_bits)
    return contextlib.nullcontext()


def _sparse_budget(text: str) -> int | float:
    """``0.1`` (a fraction of the context, in (0, 1]) or a token count (``2048``, ``2K``)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and 0.0 < value <= 1.0 and not text.strip().isdigit():
        return value
    return tokens("--sparse-tokens")(text)


def _sparse_selection_bytes(args: argparse.Namespace, model, context: int) -> int:
    """One layer's KV of the tokens a sparse step attends (its staging buffer), in whole blocks."""
    from tierkv import TieredCache

    budget = args.sparse_tokens if isinstance(args.sparse_tokens, int) else math.ceil(args.sparse_tokens * context)
    blocks = -(-budget // args.block_tokens) + 2  # the sinks' and the recent window's blocks may come on top
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return blocks * args.block_tokens * TieredCache.kv_bytes_per_token(model.config, torch.float32) // layers


def _live_table(cache, tokens: list[int], elapsed: float, decode: int) -> Table:
    """A narrow panel (under 50 columns) that every terminal shows without wrapping."""
    stats = cache.stats()
    rate = f", {(len(tokens) - 1) / elapsed:.1f} tok/s" if len(tokens) > 1 and elapsed > 0 else ""
    table = Table(title=f"decoding {len(tokens)}/{decode}{rate}", title_justify="left")
    table.add_column("tier")
    table.add_column("blocks", justify="right")
    table.add_column("KV", justify="right")
    for tier, nbytes in stats["bytes_resident"].items():
        table.add_row(tier, str(stats["blocks"][tier]), format_bytes(nbytes))
    for link, nbytes in stats["bytes_moved"].items():
        if nbytes:
            table.add_row(f"moved {link}", "", format_bytes(nbytes))
    table.add_row("prefetch stall", "", f"{stats['prefetch_stall_s']:.3f} s")
    return table


def _reference(model, prompt: list[int], decode: int, chunk: int) -> list[int]:
    """Greedy tokens with transformers' in-memory DynamicCache, prefilled in the same chunks."""
    from transformers import DynamicCache

    with torch.inference_mode():
        return greedy(model, prompt, decode, DynamicCache(), chunk).tokens


def _yes_no(value: bool) -> str:
    return "[green]yes[/green]" if value else "[red]no[/red]"


def _print_summary(console: Console, summary: dict) -> None:
    table = Table(title="tierkv demo")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("context", f"{summary['context']:,} tokens")
    table.add_row("KV size", format_bytes(summary["kv_bytes"]))
    budgets = summary["budgets"]
    table.add_row("budgets", f"device {format_bytes(budgets['device'])}, host {format_bytes(budgets['host'])}")
    table.add_row("executor", summary["executor"])
    for tier, nbytes in summary["bytes_resident"].items():
        table.add_row(f"resident on {tier}", f"{format_bytes(nbytes)} ({summary['blocks'][tier]} blocks)")
    for link, nbytes in summary["bytes_moved"].items():
        if nbytes:
            table.add_row(f"moved {link}", format_bytes(nbytes))
    table.add_row("prefill", f"{summary['prefill_tokens_per_s']:,.0f} tok/s")
    rate = summary["decode_tokens_per_s"]
    steps = summary["decode_steps"]
    table.add_row("decode", f"{rate:.2f} tok/s over {steps} steps" if rate is not None else
                  "no decode step (--max-new-tokens 1)")
    table.add_row("prefetch stall", f"{summary['prefetch_stall_s']:.3f} s")
    table.add_row("disk engine", str(summary["disk_engine"]))
    sparse = summary["sparse"]
    if sparse and sparse.get("steps"):
        table.add_row("sparse steps read", f"{sparse['selected_fraction']:.1%} of the blocks, "
                      f"{format_bytes(int(sparse['bytes_fetched_per_step']))} per step")
    if summary["expected"] is not None:
        table.add_row("expected answer", summary["expected"])
        table.add_row("answer", summary["answer"][:40])
        table.add_row("match", _yes_no(summary["match"]))
    else:
        table.add_row("answer", summary["answer"][:40])
    reference = summary["tokens_match_reference"]
    table.add_row("tokens == DynamicCache", "skipped" if reference is None else _yes_no(reference))
    console.print(table)
