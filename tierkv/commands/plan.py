"""``tierkv plan``: predict placement, tokens/s and bottleneck for a model, context and machine.

Example::

    tierkv plan --model llama-3-8b --context 1M --gpu-gb 20 --cpu-gb 128 --link pcie5 --disk nvme-gen4

Errors the user can fix (bad sizes, a KV that does not fit) print one line on stderr and exit with status 2
(see :mod:`tierkv.cli`).
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tierkv import settings
from tierkv.commands import (
    add_json_argument,
    chunk_tokens,
    integer,
    json_to_stdout,
    named_path,
    number,
    past_trained,
    size,
    sparse_tokens,
    tokens,
    write_json,
)
from tierkv.errors import CapacityError, InvalidConfigError
from tierkv.model_presets import model_names
from tierkv.planner import (
    CPU,
    DEVICES,
    GPU_KEY,
    PLAN_BLOCK_TOKENS,
    QUICK_NOTE,
    WARNINGS_KEY,
    ExecutorOption,
    Plan,
    PlanRequest,
    WhatIf,
    build_request,
    compare_executors,
    fastest_advice,
    host_attention_rate,
    host_estimate_applies,
    min_device_bytes,
    plan,
    sparse_advice,
    sparse_what_if,
    split_what_if,
    what_ifs,
)
from tierkv.staging import DEFAULT_REST_BITS, MAX_PREFETCH_DEPTH, REST_BITS, default_page_tokens, sparse_budget_tokens
from tierkv.units import format_bytes, format_tokens
from tierkv.vocabulary import PLAN_EXECUTORS, LinkName

USAGE_ERRORS = (CapacityError,)  # a KV that does not fit the budgets given is a usage error here, not a failure
FILE_SETTINGS = ("profile",)  # $TIERKV_PROFILE gives the links when --profile does not; nothing is traced
PRESETS_SOURCE = "presets"
"""Where a plan's links come from without a profile (``--link``, ``--disk``, ``--device``)."""
MAX_COMPUTE_MS = 1e6
"""Largest --compute-ms-per-token: 1,000 s a token is beyond any decoder (a slip, not a machine)."""
MAX_HOST_CORES = 1 << 16
"""Largest --host-cores."""
MAX_DRAM_GBPS = 1e5
"""Largest --host-dram-gbps: 100 TB/s, far past any host's memory."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True,
        help=f"a model name ({', '.join(model_names())}; smollm2, gemma3 and demo as tierkv demo takes them) or "
             "the path of a HF config.json"
    )
    parser.add_argument("--context", required=True, type=tokens("--context"),
                        help="tokens per sequence: 32768, 128K, 1.5K, 1M (binary K/M)")
    parser.add_argument("--batch", type=integer("--batch", 1), default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--gpu-gb", required=True, type=size("--gpu-gb"),
                        help="KV cache device budget: GB (20) or a size ('20GiB', '512MB')")
    parser.add_argument("--cpu-gb", required=True, type=size("--cpu-gb"), help="pinned host budget: GB or a size")
    parser.add_argument("--disk-gb", type=size("--disk-gb"), default=None,
                        help="disk budget: GB or a size (default: no limit)")
    parser.add_argument(
        "--link", choices=["pcie4", "pcie5"], default=None, help="PCIe preset (default pcie4)"
    )
    parser.add_argument(
        "--disk", choices=["nvme-gen4", "nvme-gen5"], default=None, help="NVMe preset (default nvme-gen4)"
    )
    parser.add_argument(
        "--profile",
        type=named_path("--profile"),
        default=None,
        help="measured LinkProfile JSON (from `tierkv bench`; default $TIERKV_PROFILE, else presets); --link/--disk "
             "override",
    )
    parser.add_argument(
        "--device",
        choices=[*DEVICES, CPU],
        default=None,
        help="compute roofline: a GPU preset, or cpu (a CPU-only host: memory links are memcpy, compute from "
             "--profile's measurement or a CPU preset); default h100-sxm, or cpu with a profile measured on a "
             "CPU-only host; unused with --compute-ms-per-token",
    )
    parser.add_argument(
        "--compute-ms-per-token",
        type=number("--compute-ms-per-token", high=MAX_COMPUTE_MS, above=True),
        default=None,
        help="device compute of one decode step (one token per sequence), instead of the roofline estimate",
    )
    parser.add_argument("--prefetch-depth", type=integer("--prefetch-depth", 0, MAX_PREFETCH_DEPTH, "the runtime cap"),
                        default=None,
                        help="layers prefetched ahead (default: auto)")
    parser.add_argument("--executor", choices=list(PLAN_EXECUTORS), default="gather",
                        help="gather: whole layers staged on the device (default); streaming: two chunks; "
                             "sparse: decode steps read only the top blocks (approximate); split: each tier's KV "
                             "attended where it lives, the host's on its CPUs (nothing staged); plan compares them all")
    parser.add_argument("--host-cores", type=integer("--host-cores", 1, MAX_HOST_CORES, "more than any host has"),
                        default=None,
                        help="split on a GPU host without a measured profile: the host's CPU cores (default 32)")
    parser.add_argument("--host-dram-gbps", type=number("--host-dram-gbps", high=MAX_DRAM_GBPS, above=True),
                        default=None,
                        help="split on a GPU host without a measured profile: host DRAM read GB/s (default 300)")
    parser.add_argument("--chunk-tokens", type=chunk_tokens(), default=4096,
                        help="streaming chunk length (default 4096)")
    parser.add_argument("--sparse-tokens", type=sparse_tokens("--sparse-tokens"), default=2048,
                        help="tokens a sparse step attends per layer, sinks and recent window included: a count "
                             "(2048, the default; 2K) or a fraction of the context (0.1), as tierkv demo and "
                             "cache.sparse(tokens=...) take; plan compares sparse with exact either way")
    parser.add_argument("--sparse-rest-bits", type=int, choices=REST_BITS, default=DEFAULT_REST_BITS,
                        help="sparse: the blocks not read are attended from a copy of this many bits kept on the "
                             f"device (default {DEFAULT_REST_BITS}, what cache.sparse() runs; 0: not attended)")
    parser.add_argument("--sparse-page-tokens", type=_page_tokens, default=None,
                        help=f"sparse: tokens per selected page, a divisor of the {PLAN_BLOCK_TOKENS}-token block "
                             f"(default: the library's, {default_page_tokens(PLAN_BLOCK_TOKENS)})")
    parser.add_argument("--what-if-gpu-gb", type=_extra_gpu, default=16 * 10**9,
                        help="extra device memory for the what-if: GB or a size (default 16)")
    add_json_argument(parser, "the plan")


def _page_tokens(text: str) -> int:
    """``--sparse-page-tokens``: a token count that divides the plans' block (refused while parsing, in flags)."""
    page = tokens("--sparse-page-tokens")(text)
    if PLAN_BLOCK_TOKENS % page:
        raise argparse.ArgumentTypeError(
            f"--sparse-page-tokens {text} does not divide the plans' {PLAN_BLOCK_TOKENS}-token block; give a "
            f"divisor of {PLAN_BLOCK_TOKENS}, e.g. {default_page_tokens(PLAN_BLOCK_TOKENS)} (the default).")
    return page


def _extra_gpu(text: str) -> int:
    """``--what-if-gpu-gb``: a size above 0 bytes (a what-if of 0 would be the plan itself)."""
    extra = size("--what-if-gpu-gb")(text)
    if extra < 1:
        raise argparse.ArgumentTypeError(f"--what-if-gpu-gb {text} adds no device memory, so its what-if would be the "
                                         "plan itself; give more, e.g. 16 (GB, the default).")
    return extra


def _ms(seconds: float) -> str:
    """A duration that never rounds a real cost to ``0.0 ms``: ``'2,564.2 ms'``, ``'0.4 ms'``, ``'41.3 us'``."""
    ms = seconds * 1e3
    if ms == 0:
        return "0 ms"
    if abs(ms) >= 0.05:
        return f"{ms:,.1f} ms"
    return f"{ms * 1e3:.3g} us"


def _rate(tokens_per_s: float) -> str:
    """Tokens/s with three significant figures at most: ``'0.39'``, ``'61,600'`` (no false precision)."""
    if tokens_per_s >= 1000:
        return f"{float(f'{tokens_per_s:.3g}'):,.0f}"
    return f"{tokens_per_s:.3g}"


def _render(console: Console, result: Plan, alternatives: list[WhatIf], advice: str, links_from: str) -> None:
    """The plan as one table read top to bottom: where the KV lives, what moves, then how the step adds up."""
    req, fc = result.request, result.forecast
    tiers = result.bytes_per_tier
    table = Table(title=f"tierkv plan: {escape(req.model.name)}, context {req.context:,} x batch {req.batch}")
    table.add_column("quantity", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    if links_from != PRESETS_SOURCE:  # (the presets name themselves in the "via" column)
        table.add_row("links from", escape(links_from))
    table.add_row("KV per token", format_bytes(result.kv_bytes_per_token))
    table.add_row("KV total", format_bytes(result.kv_bytes_total))
    what = {"streaming": "2 chunks",
            "sparse": f"2 chunks + {req.sparse_tokens:,}-token selection + key summaries"
                      + (f" + {req.sparse_rest_bits}-bit rest copy" if req.sparse_rest_bits else ""),
            "split": "2 prefill chunks" + ("" if req.links.serial_mover else " + decode scratch")
                     + "; no layer staged"}.get(
        req.executor, f"{fc.prefetch_depth + 1} layers" if fc.prefetch_depth or req.prefetch_depth == 0 else
        f"1 layer; prefetch off: reading ahead needs {format_bytes(min_device_bytes(req, req.prefetch_depth or 1))}")
    table.add_row("device staging", f"{format_bytes(result.staging_bytes)} ({what})")
    table.add_row("KV on device / host / disk",
                  " / ".join(format_bytes(n) for n in (tiers.device, tiers.host, tiers.disk)))
    for key, nbytes in result.bytes_moved_per_step.items():
        if nbytes:
            link = req.links.links.get(key)
            via = f" via {escape(link.name)}" if link else ""
            verb = "gathered on device" if key == LinkName.DEVICE_TO_DEVICE else f"moved {key}"
            table.add_row(f"{verb} per token", f"{format_bytes(nbytes / req.batch)}{via}")
    table.add_section()
    busy = result.busy_rows()
    if result.host_attention is not None:  # split: nothing is gathered; the CPUs attend at this rate
        table.add_row("host attention rate", f"{result.host_attention.bytes_per_s / 1e9:,.1f} GB/s")
        table.add_row("  from", escape(result.host_attention.source))
        (label, seconds), *rest = busy
        table.add_row(f"{label} ({result.compute_source})", _ms(seconds))
        for label, seconds in rest:
            table.add_row(label, _ms(seconds))
        combine = "max(compute + attention, disk)" if fc.attention_on_compute else "max of the busy rows"
    else:
        table.add_row(f"compute per step ({result.compute_source})", _ms(result.compute_s_per_step))
        device_label, device_s = busy[0]
        extra = "+ per-layer work, contention" if req.links.serial_mover else "+ device gather, per-layer work"
        table.add_row(extra, _ms(device_s - result.compute_s_per_step))
        table.add_row(f"= {device_label}", _ms(device_s))
        for label, seconds in busy[1:]:
            table.add_row(label, _ms(seconds))
        combine = "max of the busy rows"  # (the planner reads the disk ahead: never inside the mover's job)
    table.add_row(f"bound: {combine}", f"{_ms(fc.lower_bound_s)} ({result.bound_label})")
    table.add_row("+ not overlapped (fill, stalls)", _ms(max(0.0, fc.step_s - fc.lower_bound_s)))
    table.add_row("= predicted step", _ms(fc.step_s))
    table.add_row("tokens/s", _rate(result.tokens_per_s))
    table.add_row("overlap efficiency (bound / step)", f"{fc.overlap_efficiency:.1%}")
    console.print(table)

    if alternatives:
        wi = Table(title="what-if (re-planned as the runtime would place the KV)")
        # a narrow terminal folds a cell onto more lines: cut short ("13,0…") a number reads as another one
        wi.add_column("change", overflow="fold")
        wi.add_column("step", justify="right", overflow="fold")
        wi.add_column("tokens/s", justify="right", overflow="fold")
        wi.add_column("speed-up", justify="right", overflow="fold")
        wi.add_column("bound", overflow="fold")
        for alt in alternatives:
            p = alt.plan
            wi.add_row(escape(alt.label), _ms(p.forecast.step_s), _rate(p.tokens_per_s),
                       f"{fc.step_s / p.forecast.step_s:.2f}x" + ("*" if alt.note else ""), p.bound_label)
        console.print(wi)
        for alt in alternatives:
            if alt.note:
                console.print(f"* {alt.label}: {alt.note}", markup=False, highlight=False)
    if advice:
        console.print(advice, markup=False, highlight=False)


def _render_executors(console: Console, base: Plan, options: list[ExecutorOption], advice: str) -> None:
    """Every executor planned for the same request, side by side, and which exact one is fastest here."""
    table = Table(title="executors on this machine (same budgets and links)")
    for name in ("executor", "staging", "step", "tokens/s", "vs gather", "bound"):
        table.add_column(name, justify="left" if name in ("executor", "bound") else "right", overflow="fold")
    gather = next((o.plan for o in options if o.executor == "gather"), None)
    for option in options:
        p = option.plan
        name = option.executor + (" (approx.)" if not option.exact else "") + (
            " *" if option.executor == base.request.executor else "")
        if p is None:
            table.add_row(name, "does not fit", "", "", "", "")
            continue
        versus = f"{gather.forecast.step_s / p.forecast.step_s:.2f}x" if gather is not None else ""
        table.add_row(name, format_bytes(p.staging_bytes), _ms(p.forecast.step_s), _rate(p.tokens_per_s), versus,
                      p.bound_label)
    table.caption = "* this plan"
    console.print(table)
    for option in options:
        if option.plan is None:
            console.print(f"{option.executor}: {option.note}", markup=False, highlight=False)
    if advice:
        console.print(advice, markup=False, highlight=False)


def _notes(result: Plan, sparse: int | float, source: str) -> list[str]:
    """What the plan's numbers do not say: the plan's own notes, a context past the model's trained length (the
    bytes are priced, not whether it answers there), a profile (from ``source``) of a CPU-only host priced for a GPU
    device, a ``--quick`` profile, one that ``tierkv bench`` doubted, a sparse budget that covers the whole context
    (sparse then reads every token)."""
    req = result.request
    notes = list(result.notes)
    profile = "the --profile" if source.startswith("--profile") else f"the profile ({source})"
    trained = req.model.max_positions
    if trained is not None and req.context > trained:
        notes.append(past_trained(req.context, req.model.name, trained, "max_position_embeddings")
                     + ": the plan prices bytes and time, not answer quality there.")
    machine = req.links.machine
    if req.links.serial_mover and req.device.name in DEVICES:
        notes.append(f"{profile} was measured on a host without a GPU (gpu: {machine.get(GPU_KEY, 'none')}): its "
                     f"links are memcpy within host memory and its mover one thread, yet --device {req.device.name} "
                     "is planned with them; measure with `tierkv bench` on the target GPU host, or drop --profile to "
                     "plan with presets (--link, --disk).")
    warnings = machine.get(WARNINGS_KEY, "")
    if warnings.endswith(QUICK_NOTE):
        notes.append(f"{profile} was measured by `tierkv bench --quick` (small sizes: a smoke test): its links are "
                     "indicative only; measure without --quick before planning with it.")
        warnings = warnings.removesuffix(QUICK_NOTE).removesuffix("; ")
    if warnings:
        notes.append(f"{profile} was measured with warnings ({warnings}); re-run `tierkv bench` on a quiet "
                     "machine before trusting its links.")
    if req.sparse_tokens >= req.context:
        given = format_tokens(sparse) if isinstance(sparse, int) else f"{sparse:g}"
        notes.append(f"--sparse-tokens {given} covers the whole {format_tokens(req.context)}-token context: "
                     "sparse reads every token (no sparse what-if); give fewer tokens or a fraction, e.g. 0.1.")
    return notes


def _profile(args: argparse.Namespace) -> tuple[str | None, str]:
    """The profile file the plan reads, and where it came from for the output: ``--profile``, else
    ``$TIERKV_PROFILE`` (as a cache reads it), else none (presets)."""
    if args.profile is not None:
        return args.profile, f"--profile {args.profile}"
    path = settings.get("profile")
    if path is not None:
        return str(path), settings.source("profile")
    return None, PRESETS_SOURCE


def _check_host_options(args: argparse.Namespace, request: PlanRequest, source: str) -> None:
    """Refuse ``--host-cores``/``--host-dram-gbps`` where the links give the host attention rate instead (a
    measured profile, a CPU host's memcpy): they would be silently ignored."""
    given = [flag for flag, value in (("--host-cores", args.host_cores), ("--host-dram-gbps", args.host_dram_gbps))
             if value is not None]
    if given and not host_estimate_applies(request.links):
        found = host_attention_rate(request.links)
        rate = f"{found.bytes_per_s / 1e9:,.1f} GB/s, {found.source.split(':')[0]}"
        flags = " and ".join(given)
        raise InvalidConfigError(f"{flags} set the host attention estimate of a GPU host planned with presets; this "
                                 f"plan's links ({source}) set it instead ({rate}): leave {flags} out.")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=json_to_stdout(args))
    profile, source = _profile(args)
    request = build_request(
        args.model,
        args.context,
        gpu=f"{args.gpu_gb}B",
        cpu=f"{args.cpu_gb}B",
        disk=None if args.disk_gb is None else f"{args.disk_gb}B",
        batch=args.batch,
        link=args.link,
        disk_link=args.disk,
        profile=profile,
        device=args.device,
        compute_ms_per_step=args.compute_ms_per_token,
        prefetch_depth=args.prefetch_depth,
        executor=args.executor,
        chunk_tokens=args.chunk_tokens,
        sparse_tokens=sparse_budget_tokens(args.sparse_tokens, args.context),
        sparse_rest_bits=args.sparse_rest_bits,
        sparse_page_tokens=args.sparse_page_tokens,
        host_cores=args.host_cores,
        host_dram_gbps=args.host_dram_gbps,
    )
    _check_host_options(args, request, source)
    result = plan(request)
    options = compare_executors(result)
    alternatives = what_ifs(result, extra_gpu_bytes=args.what_if_gpu_gb)
    split = split_what_if(result, options)
    other = sparse_what_if(result)
    advice = sparse_advice(result, other)
    alternatives += [alt for alt in (split, other) if alt is not None]
    _render(console, result, alternatives, advice, source)
    fastest = fastest_advice(options)
    _render_executors(console, result, options, fastest)
    notes = _notes(result, args.sparse_tokens, source)
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if args.json:
        data = result.to_dict()
        data["links_from"] = source
        data["sparse_advice"] = advice
        data["fastest_advice"] = fastest
        data["notes"] = notes
        data["executors"] = [
            {"executor": o.executor, "attention": o.note if o.plan is not None else "",
             "fits": o.plan is not None, "reason": o.note if o.plan is None else "",
             **({"predicted_step_s": o.plan.forecast.step_s, "tokens_per_s": o.plan.tokens_per_s,
                 "staging_bytes": o.plan.staging_bytes, "bottleneck": o.plan.forecast.bottleneck.value,
                 **({"host_attention_bytes_per_s": o.plan.host_attention.bytes_per_s,
                     "host_attention_source": o.plan.host_attention.source} if o.plan.host_attention else {})}
                if o.plan is not None else {})}
            for o in options
        ]
        data["what_ifs"] = [
            {
                "change": alt.label,
                "predicted_step_s": alt.plan.forecast.step_s,
                "tokens_per_s": alt.plan.tokens_per_s,
                "bottleneck": alt.plan.forecast.bottleneck.value,
                "note": alt.note,
            }
            for alt in alternatives
        ]
        written = write_json(data, args.json)
        if written:
            console.print(f"wrote {written}", markup=False, highlight=False, soft_wrap=True)
    return 0
