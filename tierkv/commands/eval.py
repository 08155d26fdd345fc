"""``tierkv eval``: retrieval accuracy over context lengths and needle depths, and sparse attention's quality.

    tierkv eval --lengths 4K,16K,32K,64K --depths 0,0.25,0.5,0.75,1 --samples 4 --out results/
    tierkv eval --model smollm2 --tasks needle,multi-needle,fidelity --lengths 2K,4K,8K --depths 0.1,0.5,0.9 \
        --samples 1 --budgets 0.02,0.05,0.1 --out results/quality/smollm2

Prints a depth x length table, and with ``--out`` writes ``eval.json`` and ``heatmap.png`` there; ``--json
[PATH]`` writes the record to PATH or stdout (the table then goes to stderr).
``--cache tiered`` runs every trial through a ``TieredCache`` (all three tiers; ``--executor``) instead of
the in-memory ``DynamicCache``: exact attention must give the same table.

With ``--tasks`` it measures approximate attention against full attention instead (:mod:`tierkv.quality`,
docs/quality.md): needle, multi-needle and next-token fidelity prompts for a named model (``demo`` or
``smollm2``), full attention first (``--stage reference``: prefill once, save the KV and full attention's
answers and distributions in ``--out``), then tierkv's exact and sparse executors from that KV (``--stage
measure``, one sparse run per ``--budgets`` fraction, into ``tierkv*.json`` named by every option that changes a
result: :func:`tierkv.quality.harness.results_file`). kvpress runs on the same ``--out`` folder in its own
environment (benchmarks/quality/kvpress_run.py).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tierkv import safefs
from tierkv.commands import (
    add_json_argument,
    check_fits_machine,
    chunk_tokens,
    fractions,
    integer,
    json_to_stdout,
    model_or_folder,
    require_model_package,
    seed,
    size,
    token_list,
    tokens,
    writable_dir,
    write_json,
)
from tierkv.commands.progress import (
    Phases,
    Ticker,
    between,
    first_load,
    forward_cost,
    importing,
    load_label,
    quiet_transformers,
    seconds,
)
from tierkv.errors import BudgetTooSmallError, InvalidConfigError
from tierkv.inputs import printable
from tierkv.quality.tasks import TASKS
from tierkv.staging import REST_BITS
from tierkv.units import format_size_option, format_tokens, plural
from tierkv.vocabulary import CLI_EXECUTORS

if TYPE_CHECKING:
    from tierkv.quality.harness import CacheSetup

CHUNK_TOKENS = 4096  # --chunk-tokens' default
PROGRESS_EVERY_S = 8.0  # a trial's prefill reports its progress at least this often (a 64K trial takes minutes)
TIER_OVERHEAD = 1.5  # --cache tiered's time over the in-memory roofline estimate (as tierkv demo's)
TRIAL_FIXED_S = 0.5
"""Seconds each trial costs beside its forwards' roofline: its haystack's text and tokens, and the greedy answer's
per-token Python work (0.4-0.6 s a trial of 64 tokens on a 2-core VM); without it 0.2-0.7 s was said of a 3 s
run, and "between 0.0 s and 0.0 s" of a 64-token one."""


MAX_SAMPLES = 10_000  # haystacks per (length, depth) cell: more is days of decoding at any length
CHECKED_SAMPLES = 256  # haystacks of the shortest length built before the model loads (each a few ms)


FILE_SETTINGS = ("profile", "trace")  # the caches read $TIERKV_PROFILE, trace to $TIERKV_TRACE (tierkv.cli)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=token_list("--lengths"), default="4K,16K,32K,64K",
                        help="context lengths in tokens, e.g. 4K,1.5K,32768 (default: %(default)s)")
    parser.add_argument("--depths", type=fractions("--depths"), default="0,0.25,0.5,0.75,1",
                        help="needle depths in [0, 1] (default: %(default)s)")
    parser.add_argument("--samples", type=integer("--samples", 1, MAX_SAMPLES, "haystacks per cell"), default=4,
                        help="seeded haystacks per cell (default: %(default)s)")
    parser.add_argument("--kind", default="passkey", choices=("passkey", "multikey"), help="task (default: passkey)")
    parser.add_argument("--seed", type=seed(), default=0, help="haystack seed (default: %(default)s)")
    parser.add_argument("--model", type=model_or_folder("--model"), default=None,
                        help="a named model (demo, smollm2, gemma3) or a demo-model folder (default: the packaged "
                             "demo model)")
    parser.add_argument("--device", type=_device, default="cpu",
                        help="torch device: cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=tokens("--prefill-chunk"), default=2048,
                        help="prefill tokens per forward (default: %(default)s)")
    parser.add_argument("--cache", default="dynamic", choices=("dynamic", "tiered"),
                        help="dynamic: full attention in memory (DynamicCache); tiered: TieredCache over three tiers")
    parser.add_argument("--executor", default=None, choices=[n for n in CLI_EXECUTORS if n != "sparse"],
                        help="with --cache tiered: streaming attention or exact gather (default: streaming)")
    parser.add_argument("--chunk-tokens", type=chunk_tokens(), default=None,
                        help=f"with --executor streaming: tokens per attention chunk (default: {CHUNK_TOKENS})")
    parser.add_argument("--gpu-gb", type=size("--gpu-gb"), default=None,
                        help="with --cache tiered: device budget, GB or a size (default: the executor's minimum + "
                             "1/8 of the longest prompt's KV)")
    parser.add_argument("--cpu-gb", type=size("--cpu-gb"), default=None,
                        help="with --cache tiered: host budget (default: 1/4 of that KV)")
    parser.add_argument("--disk-dir", type=writable_dir("--disk-dir"), default=None,
                        help="with --cache tiered: disk tier folder (default: a temp dir)")
    parser.add_argument("--out", type=writable_dir("--out"), default=None,
                        help="folder for eval.json and heatmap.png (with --tasks: for the reference KV and every "
                             "result), created if missing")
    quality = parser.add_argument_group("sparse attention quality (docs/quality.md)")
    quality.add_argument("--tasks", type=_task_list, default=None,
                         help=f"measure approximate attention on these tasks ({', '.join(TASKS)}) instead of the "
                              "retrieval heat map")
    quality.add_argument("--budgets", type=_budget_list, default=None,
                         help="sparse budgets, fractions of the context in (0, 1] (default: "
                              f"{QUALITY_DEFAULTS['budgets']})")
    quality.add_argument("--methods", type=_method_list, default=None,
                         help="tierkv methods next to full attention: exact, sparse (default: "
                              f"{QUALITY_DEFAULTS['methods']})")
    quality.add_argument("--stage", choices=("all", "reference", "measure"), default=None,
                         help="reference: full attention only; measure: the methods on every prompt of the "
                              "reference in --out (no --tasks needed), into a results file named by the sparse "
                              "options given (tierkv.json, tierkv-8-sinks0-rest2.json, ...): a run resumes only "
                              "results measured with its own options; default: both")
    quality.add_argument("--fidelity-steps", type=integer("--fidelity-steps", 2), default=None,
                         help="decode steps compared per fidelity prompt (default: "
                              f"{QUALITY_DEFAULTS['fidelity_steps']})")
    quality.add_argument("--block-tokens", type=tokens("--block-tokens"), default=None,
                         help=f"tokens per block of the sparse runs (default: {QUALITY_DEFAULTS['block_tokens']})")
    quality.add_argument("--sinks", type=integer("--sinks", 0), default=None,
                         help="sparse sink tokens (default: one block)")
    quality.add_argument("--recent", type=integer("--recent", 0), default=None,
                         help="sparse recent-window tokens (default: one block)")
    quality.add_argument("--dense-layers", type=integer("--dense-layers", 0), default=None,
                         help="sparse: first layers attended in full, within the budget (default: 0)")
    quality.add_argument("--rest-bits", type=int, choices=REST_BITS, default=None,
                         help="sparse: attend the pages not read from a copy of this many bits on the device "
                              "(default: 0, not at all)")
    quality.add_argument("--page-tokens", type=integer("--page-tokens", 1), default=None,
                         help="sparse: tokens per selected page, a divisor of --block-tokens (default: the "
                              "library's; equal to --block-tokens: whole blocks)")
    add_json_argument(parser, "the result (every trial)")


def _device(text: str) -> str:
    """``--device``: a torch device this torch can run on, checked while parsing (not as a traceback mid-run)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"--device {text!r} is not a torch device; give cpu, cuda or "
                                         "cuda:N.") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"--device {text!r}: tierkv eval runs on cpu or cuda; give cpu, cuda or "
                                         "cuda:N.")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device {text!r}: this torch ({torch.__version__}) sees no CUDA GPU; "
                                         "give --device cpu, or install a CUDA build of torch on a GPU host.")
    if device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise argparse.ArgumentTypeError(f"--device {text!r}: this host has {plural(count, 'CUDA GPU')}; give "
                                         f"cuda:0 to cuda:{count - 1}.")
    return text


QUALITY_DEFAULTS: dict[str, object] = {"budgets": "0.02,0.05,0.1", "methods": "exact,sparse", "stage": "all",
                                       "fidelity_steps": 256, "block_tokens": 16, "sinks": None, "recent": None,
                                       "dense_layers": 0, "rest_bits": 0, "page_tokens": None}
"""The options of the quality runs (``--tasks``, ``--stage measure``) and their defaults (strings: as typed)."""

TIERED_ONLY = ("gpu_gb", "cpu_gb", "disk_dir", "executor", "chunk_tokens")
"""The options that size or run the ``TieredCache`` of ``--cache tiered`` (meaningless with the in-memory cache)."""


def _check_combination(args: argparse.Namespace) -> None:
    """Options that apply only with another, refused before the model loads (a default eval runs for minutes);
    then the tiered defaults filled in."""
    given = [f"--{name.replace('_', '-')}" for name in TIERED_ONLY if getattr(args, name) is not None]
    them = "it" if len(given) == 1 else "them"
    if given and (args.tasks or args.stage == "measure"):
        raise InvalidConfigError(f"{', '.join(given)}: the quality runs (--tasks, --stage measure) size their own "
                                 f"caches; leave {them} out.")
    if given and args.cache != "tiered":
        raise InvalidConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with --cache "
                                 f"tiered (the default --cache dynamic keeps the KV in memory); add --cache tiered or "
                                 f"leave {them} out.")
    if args.chunk_tokens is not None and args.executor == "gather":
        raise InvalidConfigError("--chunk-tokens applies only with --executor streaming (exact gather stages whole "
                                 "layers); leave it out, or give --executor streaming.")
    from tierkv.quality.run_folder import REFERENCE_FILE

    if args.stage == "measure" and args.out is not None and not (args.out / REFERENCE_FILE).is_file():
        raise InvalidConfigError(f"--out {str(args.out)!r} holds no reference ({REFERENCE_FILE}): run `tierkv eval "
                                 "--stage reference --out DIR` (or --stage all) into it first.")
    check_fits_machine("--gpu-gb", args.gpu_gb)  # given budgets: before the model loads (defaults: _cache_mode)
    check_fits_machine("--cpu-gb", args.cpu_gb)
    args.executor = args.executor or "streaming"
    args.chunk_tokens = args.chunk_tokens or CHUNK_TOKENS
    quality = [f"--{name.replace('_', '-')}" for name in QUALITY_DEFAULTS if getattr(args, name) is not None]
    if quality and not args.tasks and args.stage != "measure":
        them = "it" if len(quality) == 1 else "them"
        raise InvalidConfigError(f"{', '.join(quality)} {'applies' if len(quality) == 1 else 'apply'} only to the "
                                 "sparse attention quality runs; add --tasks (e.g. --tasks needle --out DIR) or "
                                 f"leave {them} out (the retrieval heat map ignores {them}).")
    defaults = {"budgets": _budget_list, "methods": _method_list}
    for name, default in QUALITY_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[name](default) if name in defaults else default)  # type: ignore[arg-type]


def _check_lengths(args: argparse.Namespace) -> None:
    """Every haystack of the shortest ``--lengths`` built before the model loads: one too short for the task's
    needles and question is refused in this command's flags."""
    from tierkv.demo.evaluate import trial_example

    shortest = min(args.lengths)
    try:
        for depth in args.depths:
            for sample in range(min(args.samples, CHECKED_SAMPLES)):
                trial_example(args.kind, args.seed, shortest, depth, sample)
    except InvalidConfigError as exc:
        raise InvalidConfigError(f"--lengths {format_tokens(shortest)} is too short for --kind {args.kind}: "
                                 f"{str(exc).split('; ')[-1]}; give longer --lengths.") from None


def _task_list(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if not tasks or unknown:
        raise argparse.ArgumentTypeError(f"--tasks={text!r}: valid tasks are {', '.join(TASKS)}.")
    return tasks


def _budget_list(text: str) -> list[float]:
    """``--budgets``: fractions of the context in (0, 1], as ``cache.sparse(model, tokens=f)`` takes them, refused
    while parsing in this option's terms (a budget of 0 attends nothing)."""
    budgets = []
    for part in (part.strip() for part in text.split(",")):
        if not part:
            continue
        try:
            budget = float(part)
        except ValueError:
            budget = math.nan
        if not 0.0 < budget <= 1.0:  # NaN too
            raise argparse.ArgumentTypeError(f"--budgets={part!r} is not a fraction of the context in (0, 1]; give "
                                             "e.g. --budgets 0.02,0.05,0.1.")
        budgets.append(budget)
    if not budgets:
        raise argparse.ArgumentTypeError(f"--budgets={text!r} has no values; give e.g. --budgets 0.02,0.05,0.1.")
    return budgets


def _method_list(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if not methods or any(m not in ("exact", "sparse") for m in methods):
        raise argparse.ArgumentTypeError(f"--methods={text!r}: give exact, sparse or both.")
    return methods


def _cache_mode(args: argparse.Namespace, model, longest: int, tmp: str):
    """``(cache_factory, cache_context, record)`` for ``--cache``: None/None for the in-memory reference, or a
    fresh ``TieredCache`` per trial with budgets sized on the longest prompt (shorter ones keep more on the
    device)."""
    if args.cache == "dynamic":
        return None, None, {"mode": "dynamic"}
    import torch

    from tierkv import TieredCache

    kv = TieredCache.kv_bytes_per_token(model.config, torch.float32) * (longest + 8)
    if args.executor == "streaming":
        floor = TieredCache.min_streaming_device_bytes(model.config, chunk_tokens=args.chunk_tokens)
    else:
        floor = TieredCache.min_device_bytes(model.config, longest + 8)
    gpu = args.gpu_gb if args.gpu_gb is not None else floor + kv // 8
    cpu = args.cpu_gb if args.cpu_gb is not None else max(kv // 4, 2**20)
    check_fits_machine("--gpu-gb", gpu, "the executor's minimum + 1/8 of the longest prompt's KV", "--lengths")
    check_fits_machine("--cpu-gb", cpu, "1/4 of the longest prompt's KV", "--lengths")
    disk = str(args.disk_dir or tmp)

    def factory() -> TieredCache:
        return TieredCache(gpu_gb=f"{gpu}B", cpu_gb=f"{cpu}B", disk_dir=disk, config=model.config)

    streaming = args.executor == "streaming"
    context = (lambda cache: cache.streaming(model, chunk_tokens=args.chunk_tokens)) if streaming else None
    return factory, context, {"mode": "tiered", "executor": args.executor, "gpu_bytes": gpu, "cpu_bytes": cpu,
                              "min_gpu_bytes": floor}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    _check_combination(args)
    with contextlib.ExitStack() as stack:
        with importing(Console(stderr=True, highlight=False)):
            stack.enter_context(quiet_transformers())
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tierkv.demo.evaluate import evaluate, plot_heatmap
    from tierkv.demo.model import load_demo_model

    lengths, depths = args.lengths, args.depths
    console = Console(stderr=json_to_stdout(args), highlight=False)
    status = Console(stderr=True, highlight=False, soft_wrap=True)  # progress: never mixed into the results
    phases = Phases(status)
    if args.tasks or args.stage == "measure":
        with _Log(status) as log:
            return _run_quality(args, console, log, phases)
    if isinstance(args.model, str) and args.model != "demo":
        raise InvalidConfigError(f"the retrieval heat map is the demo model's own task; for --model {args.model} "
                                 "give --tasks (e.g. --tasks needle,multi-needle,fidelity).")
    _check_lengths(args)
    folder = args.model if isinstance(args.model, Path) else None
    with phases.phase("loading the demo model"):
        model, tokenizer = load_demo_model(device=args.device, path=folder)
    total = len(lengths) * len(depths) * args.samples
    done = 0
    total_cost = sum(forward_cost(0, n) for n in lengths) * len(depths) * args.samples
    done_cost = 0.0  # the trials run shortest length first: time left goes by cost, not by trials
    start = time.perf_counter()
    last_line = [start]  # when progress last printed a line
    status.print(f"{plural(total, 'trial')}: {args.kind} over {', '.join(map(format_tokens, lengths))} tokens x "
                 f"{plural(len(depths), 'depth')} x {plural(args.samples, 'haystack')}, each a prefill and a greedy "
                 f"answer{_estimate(args, model)}; one line per trial")

    def progress(trial) -> None:
        nonlocal done, done_cost
        done += 1
        done_cost += forward_cost(0, trial.length)
        mark = "ok" if trial.correct else f"got {trial.output!r}"
        elapsed = time.perf_counter() - start
        left = elapsed / done_cost * (total_cost - done_cost)
        status.print(f"[{done}/{total}] {format_tokens(trial.length)} depth {trial.depth:.2f} #{trial.sample}: "
                     f"{trial.answer} {mark} ({seconds(elapsed)}, about {seconds(left)} to go)", markup=False)
        last_line[0] = time.perf_counter()

    def prefilling(tokens_done: int, tokens_total: int) -> None:
        """A line every :data:`PROGRESS_EVERY_S` within a long trial, so a long prefill is never silent."""
        now = time.perf_counter()
        if now - last_line[0] >= PROGRESS_EVERY_S and tokens_done < tokens_total:
            status.print(f"[{done + 1}/{total}] prefill {format_tokens(tokens_done)}/{format_tokens(tokens_total)} "
                         f"tokens ({seconds(now - start)})", markup=False)
            last_line[0] = now

    with tempfile.TemporaryDirectory(prefix="tierkv-eval-") as tmp:
        factory, context, cache_record = _cache_mode(args, model, max(lengths), tmp)
        try:
            result = evaluate(model, tokenizer, lengths=lengths, depths=depths, samples=args.samples, kind=args.kind,
                              seed=args.seed, cache_factory=factory, cache_context=context,
                              prefill_chunk_size=args.prefill_chunk, on_trial=progress, on_prefill=prefilling)
        except BudgetTooSmallError as exc:  # the cache's message names its API: say it in this command's flags
            raise InvalidConfigError(
                f"--gpu-gb {format_size_option(cache_record['gpu_bytes'])} is below the minimum of --executor "
                f"{args.executor} at --lengths up to {format_tokens(max(lengths))}: give --gpu-gb "
                f"{format_size_option(cache_record['min_gpu_bytes'])} or more.") from exc
    record = result.to_dict() | {"wall_time_s": round(time.perf_counter() - start, 1), "device": args.device,
                                 "cache": cache_record}
    if args.out:
        out = Path(args.out)
        os.close(safefs.open_user_directory(out))  # created 0700 if missing
        heatmap, record_path = plot_heatmap(result, out / "heatmap.png"), write_json(record, str(out / "eval.json"))
        status.print(f"wrote {heatmap} and {record_path}", markup=False, highlight=False, soft_wrap=True)
    if args.json:
        written = write_json(record, args.json)
        if written:
            status.print(f"wrote {written}", markup=False, highlight=False, soft_wrap=True)
    title = f"{args.kind} accuracy, greedy, {plural(args.samples, 'haystack')} per cell"
    table = Table(title=title, min_width=len(title))  # a narrow table would wrap its title over lines
    table.add_column("depth", justify="right")
    for n in lengths:
        table.add_column(format_tokens(n), justify="right")
    for d in depths:
        table.add_row(f"{d:.0%}", *(f"{result.accuracy(n, d):.0%}" for n in lengths))
    table.add_row("all", *(f"[bold]{result.accuracy(n):.0%}[/bold]" for n in lengths))
    console.print(table)
    return 0


def _estimate(args: argparse.Namespace, model) -> str:
    """``", between 6 min 15 s and 25 min 00 s in all"``: the trials' roofline on this CPU (measured now, 0.1-0.5 s,
    as loaded as the host is then: a range, half to twice it), so a run of an hour (the default lengths reach 64K)
    says so before it starts; each trial's line then says the time left by the rate measured so far; ``""`` on a
    GPU. Each trial's fixed cost (:data:`TRIAL_FIXED_S`) is counted beside its forwards."""
    if args.device != "cpu":
        return ""
    from tierkv.commands.estimate import greedy_s, measure_cpu

    cpu = measure_cpu()
    per_haystack = sum(sum(greedy_s(model, cpu, n, 2, args.prefill_chunk)) for n in args.lengths)
    trials = len(args.lengths) * len(args.depths) * args.samples
    total = per_haystack * len(args.depths) * args.samples * (TIER_OVERHEAD if args.cache == "tiered" else 1.0)
    return f", {between(total + trials * TRIAL_FIXED_S)} in all by this host's speed now"


class _Log:
    """``log(message)`` for the quality harness: plain lines on stderr, each with the time since the start; within
    ``with``, a line every :data:`~tierkv.commands.progress.REESTIMATE_S` while a prompt runs (one takes 20-30 s of
    a real model on 2 cores, and the harness says only when it ends)."""

    def __init__(self, console) -> None:
        self.console = console
        self.started = self.logged = time.perf_counter()  # when the run began, when the harness last said a line
        self.ticker = Ticker(lambda _: self._say(f"still running: {seconds(time.perf_counter() - self.logged)} "
                                                 "since the last line of the run"))

    def __enter__(self) -> _Log:
        self.ticker.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.ticker.__exit__(*exc)

    def log(self, message: str) -> None:
        self._say(message)
        self.logged = time.perf_counter()
        self.ticker.beat()

    def _say(self, message: str) -> None:
        self.console.print(f"[{seconds(time.perf_counter() - self.started)}] {message}", highlight=False,
                           markup=False)


def _run_quality(args: argparse.Namespace, console, status: _Log, phases: Phases) -> int:
    """``--tasks``: full attention, then tierkv's methods from its saved KV (see the module docstring)."""
    from tierkv import models
    from tierkv.quality import harness
    from tierkv.quality.report import summary_table
    from tierkv.quality.run_folder import check_results
    from tierkv.quality.tasks import build_prompts, task_writer

    if not args.out:
        raise InvalidConfigError(f"{'--tasks' if args.tasks else f'--stage {args.stage}'} needs --out: the reference "
                                 "KV and the results are written there.")
    if args.page_tokens is not None and args.block_tokens % args.page_tokens:
        raise InvalidConfigError(f"--page-tokens {args.page_tokens} does not divide --block-tokens "
                                 f"{args.block_tokens}: give a divisor of it.")
    name = args.model if isinstance(args.model, str) else "demo"
    if isinstance(args.model, Path):
        raise InvalidConfigError("--tasks takes a named model (--model demo, smollm2 or gemma3), not a folder.")
    context = models.spec(name).context
    too_long = [n for n in args.lengths if n > context] if args.stage != "measure" else []
    if too_long:
        raise InvalidConfigError(f"--lengths {', '.join(map(format_tokens, too_long))}: model {name!r} was trained "
                                 f"for {format_tokens(context)} tokens; give lengths up to that.")
    require_model_package(name)
    out = Path(args.out)
    if out.is_dir():  # what the tables after the run read, refused before the model loads and the run starts
        os.close(safefs.open_user_directory(out))  # not one another user could have planted a reference or KV in
        check_results(out)
    with phases.phase(load_label(name), announce=first_load(name)):
        model, tokenizer = models.load(name, device=args.device)
    started = time.perf_counter()
    if args.stage in ("all", "reference"):
        prompts = build_prompts(task_writer(name, tokenizer), args.tasks, args.lengths, args.depths, args.samples,
                                args.fidelity_steps, args.seed)
        status.log(f"full attention on {plural(len(prompts), 'prompt')}")
        harness.reference(model, tokenizer, prompts, out, prefill_chunk=args.prefill_chunk, on_prompt=status.log,
                          meta={"model": name, "model_dir": str(models.checkpoint_folder(name))})
    if args.stage in ("all", "measure"):
        methods = [harness.Method("exact")] if "exact" in args.methods else []
        if "sparse" in args.methods:
            methods += [harness.Method("sparse", b) for b in args.budgets]
        setup = harness.CacheSetup(block_tokens=args.block_tokens, sinks=args.sinks, recent=args.recent,
                                   dense_layers=args.dense_layers, rest_bits=args.rest_bits,
                                   page_tokens=args.page_tokens)
        path = out / harness.results_file(setup)
        records = _resumed_records(path, setup)

        def save(record: dict) -> None:  # after every record: an interrupted run resumes where it stopped
            records.append(record)
            write_json({"model": name, "setup": setup.to_dict(), "results": records}, str(path))

        harness.measure(model, tokenizer, out, methods, setup, on_prompt=status.log, done=records, on_record=save,
                        model_name=name)
        status.log(f"{path}: {plural(len(records), 'result')} ({time.perf_counter() - started:.0f} s)")
    console.print(summary_table(out, tokenizer))
    return 0


def _resumed_records(path: Path, setup: CacheSetup) -> list[dict]:
    """The records an earlier ``--stage measure`` of the same options left in ``path`` (the file's name holds
    every option that changes a result: :func:`tierkv.quality.harness.results_file`); a file whose setup says
    other options (written before its name said them all) is refused, not resumed nor relabelled."""
    if not os.path.lexists(path):
        return []
    from tierkv.quality.harness import setup_differences
    from tierkv.quality.run_folder import RESULTS_FIX, read_results_file

    saved_setup, saved = read_results_file(path)  # a link, a huge, damaged or foreign file: refused, naming the fix
    differences = setup_differences(setup, saved_setup)
    if differences:
        said = ", ".join(f"--{name.replace('_', '-')} {'(the default)' if value is None else printable(value)[:40]}"
                         for name, value in differences.items())
        raise InvalidConfigError(f"{str(path)!r} holds results measured with {said}, not this run's options: move "
                                 "it out of --out (or rerun with those options) so that no result is reused with "
                                 "options it was not measured with.")
    if not isinstance(saved, list) or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str)
                                              and isinstance(r.get("method"), str) for r in saved):
        raise InvalidConfigError(f"results file {str(path)!r} does not list records of a prompt and a method each; "
                                 f"{RESULTS_FIX}.")
    return list(saved)

