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
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from tierkv import safefs
from tierkv.commands import (
    add_json_argument,
    check_fits_machine,
    chunk_tokens,
    existing_file,
    free_bytes,
    integer,
    json_to_stdout,
    model_or_folder,
    number,
    past_trained,
    require_model_package,
    seed,
    size,
    sparse_tokens,
    tokens,
    writable_dir,
    write_json,
)
from tierkv.commands.progress import (
    Phases,
    Remaining,
    animated,
    between,
    first_load,
    forward_cost,
    importing,
    load_label,
    quiet_transformers,
)
from tierkv.errors import BudgetTooSmallError, CapacityError, InvalidConfigError
from tierkv.staging import DEFAULT_PAGE_TOKENS, DEFAULT_REST_BITS, REST_BITS, default_page_tokens
from tierkv.units import format_bytes, format_size_option, format_tokens, plural
from tierkv.vocabulary import CLI_EXECUTORS

if TYPE_CHECKING:
    import torch

DEFAULT_CONTEXT = 32768
REAL_MODEL_DEFAULT_CONTEXT = 4096  # a 4K prefill of a 135M-270M model takes 15-30 s on two CPU cores
BLOCK_TOKENS = 64  # blocks large enough for efficient reads (sparse attention selects pages inside them)
MIN_DECODE = 16  # default decode length: enough steps for a decode rate that is not one token's noise
FEW_TOKENS_PER_WORD = 0.25  # a real tokenizer gives >= ~1 token per word; far fewer means the wrong one
TIER_OVERHEAD = 1.5  # the tiered run's time over the in-memory roofline estimate (reads, writes, bookkeeping)
ANSWER_CHARS = 40  # characters of the answer the summary table shows
CHECKPOINT_DECODE = 32  # tokens decoded from a --prompt-file by default (no expected answer to size it by)
DEFAULT_SPARSE_TOKENS = 0.1  # --sparse-tokens: a tenth of the context
PROMPT_BYTES_PER_TOKEN = 16  # a --prompt-file's bound per token of --context: text takes 3-6 bytes per token
PROMPT_MIN_BYTES = 16 << 20  # its bound without a --context that raises it: a million tokens of text and more

FILE_SETTINGS = ("profile", "trace")  # the cache reads $TIERKV_PROFILE, traces to $TIERKV_TRACE (tierkv.cli)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=tokens("--context", minimum=64), default=None,
                        help="haystack length in tokens, e.g. 8K, 1.5K, 32768 (default 32K; 4K with a real --model); "
                             "with --prompt-file, the prompt's length decides, and --context only raises the "
                             "file's size bound")
    parser.add_argument("--gpu-gb", type=size("--gpu-gb"), default=None,
                        help="device budget, GB or a size ('8MiB'); default: 1/8 of the KV plus the executor's minimum")
    parser.add_argument("--executor", choices=[*CLI_EXECUTORS, "split"], default="streaming",
                        help="streaming: chunked exact attention, device holds two chunks (default); "
                             "gather: whole layers assembled on the device; split: exact, decode steps attend each "
                             "tier's blocks where they live (host blocks on the CPU), prefill streams; sparse: "
                             "decode steps attend only the top pages (approximate; --sparse-tokens, --page-tokens)")
    parser.add_argument("--sparse-tokens", type=sparse_tokens("--sparse-tokens"), default=None,
                        help="with --executor sparse: tokens attended per layer, a count (2048, 2K) or a fraction "
                             "of the context (0.1, the default)")
    parser.add_argument("--sparse-rest-bits", type=int, choices=REST_BITS, default=None,
                        help="with --executor sparse: attend the pages not read from a copy of this many bits on the "
                             f"device (default {DEFAULT_REST_BITS}, the library's; 0: not at all)")
    parser.add_argument("--page-tokens", type=integer("--page-tokens", 1), default=None,
                        help="with --executor sparse: tokens per selected page, a divisor of --block-tokens (default: "
                             f"the library's, {DEFAULT_PAGE_TOKENS} or the largest divisor of --block-tokens below it; "
                             "--page-tokens equal to --block-tokens selects whole blocks)")
    parser.add_argument("--chunk-tokens", type=chunk_tokens(), default=1024,
                        help="chunk length of the streaming executor (default 1024)")
    parser.add_argument("--cpu-gb", type=size("--cpu-gb"), default=None, help="host budget; default: 1/4 of the KV")
    parser.add_argument("--disk-dir", type=writable_dir("--disk-dir"), default=None,
                        help="disk tier directory, created if missing (default: a temporary directory)")
    parser.add_argument("--block-tokens", type=tokens("--block-tokens"), default=BLOCK_TOKENS,
                        help="tokens per block, the unit of placement and transfer (default %(default)s)")
    parser.add_argument("--prefill-chunk", type=tokens("--prefill-chunk"), default=1024,
                        help="prefill tokens per forward (default 1024)")
    parser.add_argument("--max-new-tokens", type=tokens("--max-new-tokens", examples="16, 64 or '1K' (1024)"),
                        default=None,
                        help=f"tokens to decode (default: {MIN_DECODE}, or the answer's length if longer; with a "
                             f"named --model {MIN_DECODE // 2} or the answer's length; {CHECKPOINT_DECODE} with "
                             "--prompt-file)")
    parser.add_argument("--seed", type=seed(), default=0,
                        help="seed of the prompt the demo draws (its passkey and the text around it; default 0)")
    parser.add_argument("--depth", type=number("--depth", 0.0, 1.0), default=0.3,
                        help="needle depth in the haystack, 0..1 (default 0.3)")
    parser.add_argument("--model", type=model_or_folder("--model"), default=None,
                        help="a named model (demo, smollm2, gemma3: see tierkv.models) or a local HF checkpoint folder "
                             "(needs --prompt-file) instead of the demo model")
    parser.add_argument("--prompt-file", type=existing_file("--prompt-file"), default=None,
                        help=f"prompt text for --model, UTF-8; at most {PROMPT_MIN_BYTES >> 20} MiB, or "
                             f"{PROMPT_BYTES_PER_TOKEN} bytes per token of --context where that is more")
    parser.add_argument("--random-model", action="store_true", help="a tiny random Llama (exactness only)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the check that decodes the same tokens again with an in-memory DynamicCache "
                             "(as long as the tiered run or longer)")
    add_json_argument(parser, "the results")


def _check_combination(args: argparse.Namespace) -> None:
    """Options that only make sense together, checked before anything is loaded."""
    folder = isinstance(args.model, Path)
    if folder and not args.prompt_file:
        raise InvalidConfigError("--model needs --prompt-file with the prompt text to decode from.")
    if args.prompt_file and not folder:
        raise InvalidConfigError("--prompt-file needs --model with a checkpoint folder (the named models build "
                                 "their own haystack).")
    if args.prompt_file and not _read_prompt(args.prompt_file, args.context).strip():
        raise InvalidConfigError(f"--prompt-file {str(args.prompt_file)!r} is empty; give a file with the prompt "
                                 "text to decode from.")
    named = _named_model(args)
    limit = _trained_context(named) if named is not None else None
    decoded = (args.max_new_tokens or MIN_DECODE) if named == "demo" else 0  # its prompt is --context tokens long
    if limit is not None and args.context is not None and args.context + decoded > limit:
        took = f"takes at most {limit} positions (max_position_embeddings), {decoded} of them for the tokens it " \
            "decodes" if named == "demo" else f"was trained for {limit} tokens"
        raise InvalidConfigError(f"--context {format_tokens(args.context)}: {named} {took}; give --context "
                                 f"{format_tokens(limit - decoded)} or less.")
    if args.model and args.random_model:
        raise InvalidConfigError("--model and --random-model exclude each other; give one.")
    if isinstance(args.model, str):
        require_model_package(args.model)
    if args.sparse_tokens is not None and args.executor != "sparse":
        raise InvalidConfigError("--sparse-tokens needs --executor sparse (exact attention reads every token); add "
                                 "--executor sparse or leave it out.")
    if args.sparse_tokens is None:
        args.sparse_tokens = DEFAULT_SPARSE_TOKENS
    if args.sparse_rest_bits is not None and args.executor != "sparse":
        raise InvalidConfigError("--sparse-rest-bits needs --executor sparse (exact attention reads every block).")
    if args.sparse_rest_bits is None:
        args.sparse_rest_bits = DEFAULT_REST_BITS if args.executor == "sparse" else 0
    if args.page_tokens is not None and args.executor != "sparse":
        raise InvalidConfigError("--page-tokens needs --executor sparse (exact attention reads every block whole).")
    if args.page_tokens is not None and args.block_tokens % args.page_tokens:
        raise InvalidConfigError(f"--page-tokens {args.page_tokens} does not divide --block-tokens "
                                 f"{args.block_tokens}: give a divisor of it, e.g. --page-tokens "
                                 f"{default_page_tokens(args.block_tokens)}.")


def run(args: argparse.Namespace) -> int:
    _check_combination(args)
    _check_memory(args, args.gpu_gb, args.cpu_gb)  # given budgets, whatever the model: before anything loads
    status = Console(stderr=True, highlight=False)
    with contextlib.ExitStack() as stack:
        with importing(status):
            stack.enter_context(quiet_transformers())
            _check_device_budget(args)
        return _run(args)


def _check_device_budget(args: argparse.Namespace) -> None:
    """A ``--gpu-gb`` below the run's minimum, or a disk tier without room for the run's KV, refused before the
    model loads where its config is at hand (the demo model's file, the random Llama's): the haystack is exactly
    ``--context`` tokens, and at least :data:`MIN_DECODE` are decoded, so this minimum never exceeds the run's
    own, nor this disk share (both checked again after the load)."""
    if args.model not in (None, "demo"):
        return
    import torch

    from tierkv.demo.model import WEIGHTS_DIR, missing_files

    context = args.context or DEFAULT_CONTEXT
    if args.random_model or missing_files(WEIGHTS_DIR):
        config = _random_config(context)
    else:
        from transformers import LlamaConfig

        config = LlamaConfig.from_pretrained(WEIGHTS_DIR)
    decode = args.max_new_tokens or MIN_DECODE
    if args.block_tokens > max(context + decode, BLOCK_TOKENS):
        raise InvalidConfigError(
            f"--block-tokens {args.block_tokens:,} is more than the whole sequence ({context:,} tokens of context and "
            f"{decode:,} new): every layer's one open block would reserve {args.block_tokens:,} tokens of memory; "
            f"give at most {max(context + decode, BLOCK_TOKENS):,} ({BLOCK_TOKENS}, the default, "
            "suits any context).")
    floor = _device_floor(args, config, torch.float32, context, decode)
    if args.gpu_gb is not None and args.gpu_gb < floor:
        raise InvalidConfigError(_budget_advice(args, config, context, floor))
    kv_bytes = _kv_bytes(config, context + decode)
    gpu, cpu = _budgets(args, kv_bytes, floor)
    _check_memory(args, gpu, cpu)
    _check_disk_room(args, kv_bytes - gpu - cpu)


def _check_memory(args: argparse.Namespace, gpu: int | None, cpu: int | None) -> None:
    """Budgets beyond this machine's memory refused in flags (:func:`tierkv.commands.check_fits_machine`): the given
    ones before any model loads, the defaults before the haystack is built (minutes at tens of millions of tokens)
    or, for a real model, before the plan; the cache refuses them only later, in its own API's words."""
    sequence = "--context" if not args.max_new_tokens else \
        f"--context or --max-new-tokens ({args.max_new_tokens:,})"
    check_fits_machine("--gpu-gb", gpu, "1/8 of the KV plus the executor's minimum", sequence)
    check_fits_machine("--cpu-gb", cpu, "1/4 of the KV", sequence)


def _budgets(args: argparse.Namespace, kv_bytes: int, floor: int) -> tuple[int, int]:
    """``(device, host)`` budgets of the run: ``--gpu-gb``/``--cpu-gb``, else the executor's minimum plus 1/8 of
    the KV, and 1/4 of the KV."""
    cpu = args.cpu_gb if args.cpu_gb is not None else max(kv_bytes // 4, 2**20)
    return (args.gpu_gb if args.gpu_gb is not None else floor + kv_bytes // 8), cpu


def _run(args: argparse.Namespace) -> int:
    out = Console(stderr=json_to_stdout(args), highlight=False)
    status = Console(stderr=True, highlight=False)
    phases = Phases(status)
    model, prompt, expected, decode = _load(args, status, phases)
    kv_bytes = _kv_bytes(model.config, len(prompt) + decode)
    floor = _device_floor(args, model.config, model.dtype, len(prompt), decode)
    if args.gpu_gb is not None and args.gpu_gb < floor:  # before the plan and the run
        raise InvalidConfigError(_budget_advice(args, model.config, len(prompt), floor))
    gpu, cpu = _budgets(args, kv_bytes, floor)
    _check_memory(args, gpu, cpu)
    disk_free = _check_disk_room(args, kv_bytes - gpu - cpu)
    _announce(status, args, model, len(prompt), decode, gpu, cpu, kv_bytes, floor)
    note = _untrained_note(args)
    if note:
        status.print(f"note: {note}", markup=False, soft_wrap=True)
    with tempfile.TemporaryDirectory(prefix="tierkv-demo-") as tmp:
        try:
            result = _decode(args, model, prompt, decode, gpu, cpu, str(args.disk_dir or tmp), status, phases)
        except BudgetTooSmallError as exc:  # the cache's reason names its API: say it in this command's flags
            raise InvalidConfigError(f"--gpu-gb {format_size_option(gpu)} is too small for this run "
                                     f"({_without_api_names(exc)}); give a larger --gpu-gb, e.g. "
                                     f"--gpu-gb {format_size_option(2 * gpu)}.") from exc
        except CapacityError as exc:  # the disk filled up (the cache's fix names disk_gb, which the demo lacks)
            raise CapacityError(f"the disk tier filled {_disk_where(args)} ({format_bytes(disk_free)} free when the "
                                f"run started); {_DISK_FIX}") from exc
    answer_text = result["answer_text"]
    reference = None
    if not args.no_reference:
        with phases.phase("reference check (in-memory DynamicCache)", total=len(prompt) + decode - 1) as advance, \
                Remaining(status, "reference check", *_costs(len(prompt), decode, args.prefill_chunk)) as remaining:
            reference = _reference(model, prompt, decode, args.prefill_chunk, _forecasting(advance, remaining))
    summary = {
        "context": len(prompt),
        "kv_bytes": kv_bytes,
        "budgets": {"device": gpu, "host": cpu},
        "executor": args.executor,
        "block_tokens": args.block_tokens,
        "page_tokens": _page_tokens(args) if args.executor == "sparse" else None,
        "expected": expected,
        "answer": answer_text,
        "match": None if expected is None else answer_text.replace(" ", "").startswith(expected),
        "tokens_match_reference": None if reference is None else reference == result["tokens"],
        **{k: result[k] for k in ("bytes_resident", "bytes_moved", "blocks", "decode_tokens", "decode_steps",
                                  "decode_tokens_per_s", "prefill_tokens_per_s", "prefetch_stall_s", "disk_engine",
                                  "sparse")},
    }
    _print_summary(out, summary)
    if args.json:
        written = write_json(summary, args.json)
        if written:
            status.print(f"wrote {written}", markup=False, highlight=False, soft_wrap=True)
    exact = args.executor != "sparse"  # sparse attention is approximate: only its answer must be right
    ok = (not exact or summary["tokens_match_reference"] is not False) and (expected is None or summary["match"])
    return 0 if ok else 1


_DISK_FIX = "free space there, give a --disk-dir on a disk with more room, or a smaller --context."


def _disk_where(args: argparse.Namespace) -> str:
    """Where the disk tier lives, as the user named it: ``--disk-dir 'X'`` or the temporary directory."""
    if args.disk_dir:
        return f"--disk-dir {str(args.disk_dir)!r}"
    return f"the temporary directory {tempfile.gettempdir()!r}"


def _check_disk_room(args: argparse.Namespace, need: int) -> int:
    """The free bytes where the disk tier will live; a run whose disk share (the KV beyond the device and host
    budgets, a lower bound) exceeds the cache's default disk budget there (90% of the free space) is refused
    before the prefill, which would otherwise fail minutes in."""
    free = free_bytes(Path(args.disk_dir) if args.disk_dir else Path(tempfile.gettempdir()))
    if need > 0.9 * free:
        raise InvalidConfigError(f"this run puts at least {format_bytes(need)} of KV on disk, but "
                                 f"{_disk_where(args)} has {format_bytes(free)} free; {_DISK_FIX}")
    return free


def _device_floor(args: argparse.Namespace, config, dtype: torch.dtype, prompt: int, decode: int) -> int:
    """The cache's own minimum device budget (``TieredCache.min_*_device_bytes``) for this run's executor and
    every option it is given, up to ``prompt + decode`` tokens: the default ``--gpu-gb`` and the advice for a
    too-small one are then budgets the cache accepts. ``config`` and ``dtype``: the model's."""
    from tierkv import TieredCache

    if args.executor == "gather":
        return TieredCache.min_device_bytes(config, prompt + decode, block_tokens=args.block_tokens, dtype=dtype)
    if args.executor == "split":
        return TieredCache.min_split_device_bytes(config, block_tokens=args.block_tokens,
                                                  chunk_tokens=args.chunk_tokens, dtype=dtype)
    if args.executor == "sparse":
        return TieredCache.min_sparse_device_bytes(config, prompt + decode, tokens=args.sparse_tokens,
                                                   block_tokens=args.block_tokens, page_tokens=args.page_tokens,
                                                   rest_bits=args.sparse_rest_bits, chunk_tokens=args.chunk_tokens,
                                                   dtype=dtype)
    return TieredCache.min_streaming_device_bytes(config, block_tokens=args.block_tokens,
                                                  chunk_tokens=args.chunk_tokens, dtype=dtype)


def _budget_advice(args: argparse.Namespace, config, prompt: int, floor: int) -> str:
    """A too-small ``--gpu-gb`` in command-line terms: the minimum of this run, and the flag that lowers it."""
    from tierkv import TieredCache

    text = (f"--gpu-gb {format_size_option(args.gpu_gb)} is below this run's minimum: give --gpu-gb "
            f"{format_size_option(floor)} or more (--executor {args.executor} at --context "
            f"{format_tokens(prompt)})")
    if args.executor == "gather":
        other = TieredCache.min_streaming_device_bytes(config, block_tokens=args.block_tokens,
                                                       chunk_tokens=args.chunk_tokens)
        return text + f", or --executor streaming, which needs --gpu-gb {format_size_option(other)}."
    if args.executor == "streaming" and args.chunk_tokens > args.block_tokens:
        smaller = max(args.block_tokens, args.chunk_tokens // 4)
        other = TieredCache.min_streaming_device_bytes(config, block_tokens=args.block_tokens,
                                                       chunk_tokens=smaller)
        return text + (f", or --chunk-tokens {format_tokens(smaller)}, which needs --gpu-gb "
                       f"{format_size_option(other)}.")
    return text + "."


def _without_api_names(exc: BaseException) -> str:
    """The cache's reason, up to where it names Python API (``raise gpu_gb``, ``TieredCache.min_...``)."""
    reason = " ".join(str(exc).split())
    cut = min((i for i in (reason.find(word) for word in ("; raise", ": raise", ", raise", "gpu_gb", "TieredCache",
                                                            "cache.")) if i >= 0), default=len(reason))
    return reason[:cut].rstrip(" ;:,.")


def _tiers_used(kv_bytes: int, gpu: int, cpu: int, floor: int) -> str:
    """Where the KV goes, from the budgets: the device's share is its budget less the executor's minimum
    (``floor``: staging), the host's its budget, the disk takes the rest."""
    device_room = max(gpu - floor, 0)
    if kv_bytes <= device_room:
        return "all of it on the device, none on host or disk"
    if kv_bytes <= device_room + cpu:
        return "the rest on the host, none on disk"
    return "the rest on disk"


def _announce(status: Console, args: argparse.Namespace, model, prompt: int, decode: int, gpu: int, cpu: int,
              kv_bytes: int, floor: int) -> None:
    """What the demo does next, with a rough time range (a roofline of this host, measured now, as loaded as the
    host is then); the runs re-estimate it from their measured rate as they go. ``floor``: the executor's
    minimum device budget."""
    from tierkv.commands.estimate import greedy_s, measure_cpu

    prefill_s, decode_s = greedy_s(model, measure_cpu(), prompt, decode, args.prefill_chunk)
    tiered = TIER_OVERHEAD * (prefill_s + decode_s)
    reference = "" if args.no_reference else (
        ", then the same with an in-memory DynamicCache to check every token (transformers' own attention, often "
        "several times slower on a CPU: its time is estimated as it runs; --no-reference skips it)")
    status.print(f"plan: prefill {format_tokens(prompt)} tokens ({format_bytes(kv_bytes)} of KV) into tiers with "
                 f"budgets of {format_bytes(gpu)} (device) and {format_bytes(cpu)} (host), "
                 f"{_tiers_used(kv_bytes, gpu, cpu, floor)}, decode "
                 f"{plural(decode, 'token')} with "
                 f"--executor {args.executor} ({between(tiered)} by this host's speed now; re-estimated as it "
                 f"runs){reference}.", soft_wrap=True)


def _load(args: argparse.Namespace, status: Console, phases: Phases):
    """(model, prompt ids, expected answer or None, tokens to decode)."""
    import torch

    torch.manual_seed(args.seed)
    if isinstance(args.model, Path):
        with phases.phase(f"loading {args.model}"):
            model, tokenizer = _load_checkpoint(args.model)
        prompt = _tokenize_prompt(tokenizer, args.prompt_file, status, args.context)
        return _with_decoder(model, tokenizer), prompt, None, args.max_new_tokens or CHECKPOINT_DECODE
    if isinstance(args.model, str) and args.model != "demo":
        return _real_model_question(args, status, phases)
    if not args.random_model:
        from tierkv.demo.model import DemoWeightsMissingError, load_demo_model
        from tierkv.demo.task import make_example

        try:
            with phases.phase("loading the demo model"):
                model, tokenizer = load_demo_model()
        except DemoWeightsMissingError as exc:  # a checkout without the trained demo model
            status.print(f"[yellow]{escape(str(exc))}[/yellow]\nFalling back to a random tiny Llama (exactness only).")
        else:
            example = make_example(random.Random(args.seed), args.context or DEFAULT_CONTEXT, args.depth)
            decode = args.max_new_tokens or max(MIN_DECODE, len(example.answer_ids))
            return _with_decoder(model, tokenizer), list(example.prompt_ids), example.answer, decode
    from transformers import LlamaForCausalLM

    context = args.context or DEFAULT_CONTEXT
    model = LlamaForCausalLM(_random_config(context)).eval()
    model.decode_tokens = lambda ids: " ".join(map(str, ids))
    ids = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(args.seed))
    return model, ids.tolist(), None, args.max_new_tokens or MIN_DECODE


def _random_config(context: int):
    """The tiny random Llama's config (``--random-model``, or a checkout without the demo model's weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context + 64)


def _named_model(args: argparse.Namespace) -> str | None:
    """The :mod:`tierkv.models` name of the run's model (``demo`` by default); None for a checkpoint folder or
    ``--random-model``."""
    if isinstance(args.model, Path) or args.random_model:
        return None
    return args.model or "demo"


def _trained_context(name: str) -> int:
    from tierkv import models

    return models.spec(name).context


def _untrained_note(args: argparse.Namespace) -> str | None:
    """A note for a ``--context`` past the positions the demo model was trained on (``max_position`` of its
    ``training.json``), which it takes but was never checked at; None otherwise."""
    if _named_model(args) != "demo" or args.context is None:
        return None
    from tierkv.demo.model import WEIGHTS_DIR

    try:
        trained = int(json.loads((WEIGHTS_DIR / "training.json").read_text())["max_position"])
    except (OSError, ValueError, KeyError, TypeError):  # no training record: nothing documented to compare with
        return None
    if args.context <= trained:
        return None
    return past_trained(args.context, "demo", trained, "positions it saw in training") + \
        ": it takes them, but its answers there are untested (docs/demo.md)."


def _real_model_question(args: argparse.Namespace, status: Console, phases: Phases):
    """A named real model asked for a fact placed at ``--depth`` of a real document of ``--context`` tokens."""
    from tierkv import models
    from tierkv.quality.tasks import TextTaskWriter

    with phases.phase(load_label(args.model), announce=first_load(args.model)):
        model, tokenizer = models.load(args.model)
    prompt = TextTaskWriter(tokenizer).needle(args.context or REAL_MODEL_DEFAULT_CONTEXT, args.depth, 0, args.seed)
    status.print(f"question: {tokenizer.decode(prompt.question_ids, skip_special_tokens=True)!r}")
    decode = args.max_new_tokens or max(MIN_DECODE // 2, prompt.answer_tokens)
    return _with_decoder(model, tokenizer), list(prompt.ids), prompt.answer, decode


def _load_checkpoint(folder: Path):
    """(model, tokenizer) of a local checkpoint; every failure is one line naming the folder (tierkv.models)."""
    from tierkv import models

    return models.load_folder(folder, what=f"--model {str(folder)!r}")


def _read_prompt(path: Path, context: int | None) -> str:
    """The text of the prompt file ``path``, refused before anything is read when it holds more than
    :data:`PROMPT_BYTES_PER_TOKEN` bytes per token of ``context`` (at least :data:`PROMPT_MIN_BYTES`): a huge file
    (a sparse one costs no disk) would be allocated whole, then fail as an out-of-memory error. Only a regular file
    is opened (a FIFO is never waited on), and the read stops past the bound where its size lies (/proc)."""
    what = f"--prompt-file {str(path)!r}"
    limit = max(PROMPT_MIN_BYTES, PROMPT_BYTES_PER_TOKEN * (context or 0))
    fd = safefs.open_regular(None, path, what, follow=True)
    try:
        size = os.fstat(fd).st_size
        data = bytearray()
        if size <= limit:
            while len(data) <= limit and (chunk := os.read(fd, limit + 1 - len(data))):
                data += chunk
    finally:
        os.close(fd)
    size = max(size, len(data))
    if size > limit:
        raise InvalidConfigError(
            f"{what} is {size:,} bytes ({format_bytes(size)}), more than the {limit:,} ({format_bytes(limit)}) a "
            "prompt file may hold "
            f"({PROMPT_BYTES_PER_TOKEN} bytes per token of --context, at least {format_bytes(PROMPT_MIN_BYTES)}); "
            f"give a shorter prompt, or for one this long --context "
            f"{format_tokens(-(-size // PROMPT_BYTES_PER_TOKEN))} or more.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidConfigError(f"{what} is not UTF-8 text ({exc.reason}).") from None


def _tokenize_prompt(tokenizer, path: Path, status: Console, context: int | None = None) -> list[int]:
    """The ids of the prompt file ``path`` (read by :func:`_read_prompt`, bounded by ``context``), with a warning
    when the tokenizer makes far fewer tokens than the text has words: a checkpoint whose tokenizer files
    transformers maps to the wrong class (seen with Qwen2) silently turns a long prompt into a handful of ids."""
    text = _read_prompt(path, context)
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


def _kv_bytes(config, n_tokens: int) -> int:
    """What the tiers hold at the end (sliding-window layers: their window), which the budgets are shares of."""
    import torch

    from tierkv import TieredCache

    return TieredCache.kv_bytes_held(config, n_tokens, torch.float32)


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
    import torch

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
            status: Console, phases: Phases) -> dict:
    """The tiered run: a live panel (progress, tiers) on stderr when it is a terminal, and either way one line
    when the prefill and one when the decode ends."""
    import torch

    from tierkv import TieredCache

    live_view = animated(status)
    progress = Progress(console=status, transient=True)
    task = progress.add_task("prefill", total=len(prompt))
    marks = {"started": time.perf_counter()}
    with Remaining(status, "tiered run", *_costs(len(prompt), decode, args.prefill_chunk)) as remaining, \
            TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=disk_dir, block_tokens=args.block_tokens,
                        config=model.config) as cache, torch.inference_mode(), _executor(args, cache, model), \
            (Live(Group(progress, _live_table(cache, [], 0.0, decode)), console=status, refresh_per_second=8,
                  transient=True) if live_view else contextlib.nullcontext()) as live:

        def show(tokens: list[int], elapsed: float) -> None:
            if len(tokens) == 1:  # the prefill's logits gave the first token: the prefill is over
                phases.done(f"prefill {format_tokens(len(prompt))} tokens through the tiers",
                            time.perf_counter() - marks["started"])
            elif tokens:
                remaining.part_done()
            if live is not None:
                live.update(Group(progress, _live_table(cache, tokens, elapsed, decode)))

        def prefilled(n: int) -> None:
            progress.update(task, advance=n)
            remaining.part_done()
            show([], 0.0)

        run = greedy(model, prompt, decode, cache, args.prefill_chunk, on_prefill=prefilled, on_token=show)
        stats = cache.stats()
    if len(run.tokens) > 1:
        phases.done(f"decode {plural(len(run.tokens) - 1, 'step')} through the tiers", run.decode_s,
                    f"{(len(run.tokens) - 1) / run.decode_s:.1f} tok/s" if run.decode_s > 0 else "")
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
    """The attention executor's context: streaming, split or sparse attention, or nothing (exact gather is the
    default path)."""
    if args.executor == "streaming":
        return cache.streaming(model, chunk_tokens=args.chunk_tokens)
    if args.executor == "sparse":
        return cache.sparse(model, tokens=args.sparse_tokens, chunk_tokens=args.chunk_tokens,
                            rest_bits=args.sparse_rest_bits, page_tokens=args.page_tokens)
    if args.executor == "split":
        return cache.split(model, chunk_tokens=args.chunk_tokens)
    return contextlib.nullcontext()


def _page_tokens(args: argparse.Namespace) -> int:
    """Tokens per page sparse attention selects (and summarises) in this run's blocks."""
    from tierkv.attention.sparse import SparseBudget

    return SparseBudget(args.sparse_tokens, page_tokens=args.page_tokens).page_size(args.block_tokens)


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


def _reference(model, prompt: list[int], decode: int, chunk: int,
               advance: Callable[[int], None] = lambda n: None) -> list[int]:
    """Greedy tokens with transformers' in-memory DynamicCache, prefilled in the same chunks; ``advance(n)``
    is told of every ``n`` tokens computed."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        return greedy(model, prompt, decode, DynamicCache(), chunk, on_prefill=advance,
                      on_token=lambda tokens, elapsed: advance(1) if len(tokens) > 1 else None).tokens


def _costs(prompt: int, decode: int, chunk: int) -> tuple[list[float], list[float]]:
    """Relative costs of the parts of a greedy run (:func:`~tierkv.commands.progress.forward_cost`): every prefill
    chunk, and every decode step after the first token (timed apart: :class:`Remaining`)."""
    return [forward_cost(s, min(chunk, prompt - s)) for s in range(0, prompt, chunk)], \
        [forward_cost(prompt + i, 1) for i in range(decode - 1)]


def _forecasting(advance: Callable[[int], None], remaining: Remaining) -> Callable[[int], None]:
    """``advance`` that also tells ``remaining`` of each part done (a chunk's tokens, or one decode step)."""

    def step(n: int) -> None:
        advance(n)
        remaining.part_done()

    return step


def answer_cell(text: str, limit: int = ANSWER_CHARS) -> str:
    """A decoded answer as one table cell: newlines and other control characters escaped (``\\n``), cut to
    ``limit`` characters with an ellipsis, so a multi-line answer never prints blank rows."""
    escaped = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return escaped if len(escaped) <= limit else escaped[: limit - 3] + "..."  # ASCII: LANG=C prints it too


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
        table.add_row("sparse steps read", f"{sparse['tokens_read_fraction']:.1%} of the tokens, "
                      f"{format_bytes(int(sparse['bytes_fetched_per_step']))} per step")
        if "device_bytes_read_per_step" in sparse:  # every byte a step reads: over the links and on the device
            links = sum(sparse["link_bytes_per_step"].values())
            table.add_row("sparse step, per token", f"{format_bytes(int(links))} over the links, "
                          f"{format_bytes(int(sparse['device_bytes_read_per_step']))} read on the device")
    if summary["expected"] is not None:
        table.add_row("expected answer", summary["expected"])
        table.add_row("answer", escape(answer_cell(summary["answer"])))
        table.add_row("match", _yes_no(summary["match"]))
    else:
        table.add_row("answer", escape(answer_cell(summary["answer"])))
    reference = summary["tokens_match_reference"]
    table.add_row("tokens == DynamicCache", "skipped" if reference is None else _yes_no(reference))
    console.print(table)
